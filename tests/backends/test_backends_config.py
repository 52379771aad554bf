"""EngineConfig (files, env overrides, every error message) and the remote-store registry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbucket.backends import plugins
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig, build_backend, load_engine_config
from kvbucket.errors import ConfigError
from kvbucket.metrics import InstrumentedBackend
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key
from kvbucket.testing.seed_configs import SEED_001_MINIMAL, SEED_001_MULTI, SEED_004_COREWEAVE

LAYOUT = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=256)

def write(tmp_path: Path, text: str, name: str = "engine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


class FakeFactories:
    """Records what the registry hands to factories; returns MemoryStores."""

    def __init__(self) -> None:
        self.url_calls: list[tuple[str, dict[str, Any]]] = []
        self.plugin_calls: list[tuple[str, dict[str, Any]]] = []

    def from_url(self, url: str, extra: dict[str, Any], engine: EngineConfig) -> ObjectStore:
        self.url_calls.append((url, extra))
        return MemoryStore(url)

    def from_plugin(self, instance: str, options: dict[str, Any], engine: EngineConfig) -> ObjectStore:
        self.plugin_calls.append((instance, options))
        if "bogus" in options:
            raise ConfigError(f"remote_storage_plugin.{instance}.bogus is not an hfbucket option")
        return MemoryStore(instance)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> FakeFactories:
    f = FakeFactories()
    monkeypatch.setitem(plugins.URL_SCHEMES, "s3", f.from_url)
    monkeypatch.setitem(plugins.PLUGIN_TYPES, "hfbucket", f.from_plugin)
    return f


# ---- loading the seeds' files ---------------------------------------------------------------------


def test_seed_001_minimal_yaml_passes_plugin_options(tmp_path: Path, fakes: FakeFactories) -> None:
    cfg = EngineConfig.from_file(write(tmp_path, SEED_001_MINIMAL))
    assert cfg.remote_storage_plugins == ["hfbucket"] and cfg.local_cpu is False
    backend = build_backend(cfg, LAYOUT)
    try:
        assert isinstance(backend, InstrumentedBackend) and backend.tier == "remote:hfbucket"
        assert isinstance(backend.inner, RemoteBackend)
        assert fakes.plugin_calls == [("hfbucket", {
            "bucket_handle": "hf://buckets/my-org/lmcache-kv/prod",
            "token_env": "HF_TOKEN",
            "create_bucket_if_missing": False,
            "download_tmp_dir": "/tmp/lmcache-hfbucket",
            "metadata_cache_ttl_secs": 30,
        })]
    finally:
        backend.close()


def test_seed_001_multiple_instances(tmp_path: Path, fakes: FakeFactories) -> None:
    cfg = EngineConfig.from_file(write(tmp_path, SEED_001_MULTI))
    backend = build_backend(cfg, LAYOUT)
    try:
        assert isinstance(backend, HybridBackend)
        assert [type(t.inner) for t in backend.tiers] == [LocalCPUBackend, RemoteBackend, RemoteBackend]
        assert [t.tier for t in backend.tiers] == ["local_cpu", "remote:hfbucket.us", "remote:hfbucket.eu"]
        assert dict(fakes.plugin_calls) == {
            "hfbucket.us": {"bucket_handle": "hf://buckets/my-org/lmcache-kv/us", "token_env": "HF_US_TOKEN"},
            "hfbucket.eu": {"bucket_handle": "hf://buckets/my-org/lmcache-kv/eu", "token_env": "HF_EU_TOKEN"},
        }
    finally:
        backend.close()


def test_plain_and_instance_of_the_same_type(fakes: FakeFactories) -> None:
    cfg = EngineConfig(local_cpu=False, remote_storage_plugins=["hfbucket", "hfbucket.us"], extra_config={
        "remote_storage_plugin.hfbucket.bucket_handle": "hf://buckets/a/b",
        "remote_storage_plugin.hfbucket.us.bucket_handle": "hf://buckets/a/us",
    })
    build_backend(cfg, LAYOUT).close()
    assert dict(fakes.plugin_calls) == {"hfbucket": {"bucket_handle": "hf://buckets/a/b"},
                                        "hfbucket.us": {"bucket_handle": "hf://buckets/a/us"}}


def test_seed_004_coreweave_yaml_goes_to_the_s3_factory(tmp_path: Path, fakes: FakeFactories) -> None:
    cfg = EngineConfig.from_file(write(tmp_path, SEED_004_COREWEAVE))
    assert cfg.max_local_cpu_size == 50 and cfg.enable_async_loading is True
    assert "your-secret-access-key" not in repr(cfg) and "your-secret-access-key" not in str(cfg)
    backend = build_backend(cfg, LAYOUT)
    try:
        assert isinstance(backend.inner, PipelinedRemoteBackend)  # enable_async_loading
        ((url, extra),) = fakes.url_calls
        assert url == "s3://test-127.cwlota.com"
        assert extra["s3_region"] == "US-WEST-04A" and extra["disable_tls"] is True and len(extra) == 8
    finally:
        backend.close()


def test_json_config_file(tmp_path: Path) -> None:
    p = write(tmp_path, json.dumps({"chunk_size": 512, "local_cpu": True, "max_local_cpu_size": 0.5}),
              "engine.json")
    cfg = EngineConfig.from_file(p)
    assert cfg.chunk_size == 512 and cfg.local_cpu_bytes == 512 * 1024 * 1024


def test_build_full_stack_on_files(tmp_path: Path) -> None:
    cfg = EngineConfig(max_local_cpu_size=0.01, local_disk=f"file://{tmp_path}/disk",
                       max_local_disk_size=0.01, remote_url=str(tmp_path / "remote"),
                       extra_config={"fsync": True})
    with build_backend(cfg, LAYOUT) as backend:
        assert isinstance(backend, HybridBackend)
        assert [type(t.inner) for t in backend.tiers] == [LocalCPUBackend, LocalDiskBackend, RemoteBackend]
        remote = backend.tiers[2].inner
        assert isinstance(remote, RemoteBackend) and isinstance(remote.store.inner.inner, FileStore)
        assert remote.store.fsync is True
        backend.put(key(1), chunk_bytes(LAYOUT, 1))
        assert as_bytes(backend.get(key(1))) == chunk_bytes(LAYOUT, 1)
    assert (tmp_path / "disk").is_dir() and any((tmp_path / "remote").iterdir())


# ---- env overrides ---------------------------------------------------------------------------------


def test_env_overrides_file_values(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 256\nlocal_cpu: true\nextra_config:\n  fsync: false\n  a: 1\n")
    cfg = load_engine_config(p, env={
        "KVBUCKET_CHUNK_SIZE": "512",
        "KVBUCKET_LOCAL_CPU": "False",
        "KVBUCKET_REMOTE_URL": "memory://x",
        "KVBUCKET_EXTRA_CONFIG": '{"fsync": true}',
        "KVBUCKET_REMOTE_STORAGE_PLUGINS": "hfbucket.us,hfbucket.eu",
        "KVBUCKET_UNRELATED": "ignored",
    })
    assert cfg.chunk_size == 512 and cfg.local_cpu is False and cfg.remote_url == "memory://x"
    assert cfg.extra_config == {"fsync": True, "a": 1}  # merged key by key over the file's
    assert cfg.remote_storage_plugins == ["hfbucket.us", "hfbucket.eu"]


def test_config_file_from_env(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 128\n")
    assert load_engine_config(env={"KVBUCKET_CONFIG_FILE": str(p)}).chunk_size == 128


def test_env_plugins_as_json_and_null_url() -> None:
    env = {"KVBUCKET_REMOTE_STORAGE_PLUGINS": '["hfbucket"]', "KVBUCKET_REMOTE_URL": ""}
    cfg = load_engine_config(env=env)
    assert cfg.remote_storage_plugins == ["hfbucket"] and cfg.remote_url is None


@pytest.mark.parametrize("text", ["yes", "On", "1", "TRUE", "true"])
def test_lenient_bools_like_lmcache(text: str) -> None:
    assert load_engine_config(env={"KVBUCKET_SAVE_UNFULL_CHUNK": text}).save_unfull_chunk is True


# ---- every error names the key and the fix ----------------------------------------------------------


@pytest.mark.parametrize(("data", "expected"), [
    ({"chunk_sze": 512}, r"unknown config key 'chunk_sze' \(.*engine.yaml\): did you mean 'chunk_size'\?"),
    ({"local_cpu": "maybe"}, r"'local_cpu'.*use true or false.*got 'maybe'"),
    ({"use_layerwise": True}, r"'use_layerwise' \(.*\) is an LMCache setting that kvbucket"),
    ({"chunk_size": "big"}, r"'chunk_size'.*use a whole number.*got 'big'"),
    ({"chunk_size": 0}, r"'chunk_size'.*greater than 0"),
    ({"max_local_cpu_size": -1}, r"'max_local_cpu_size'.*greater than or equal to 0"),
    ({"local_disk": "/tmp/kv"}, r"local_disk is set but max_local_disk_size is 0 GB; set max_local_disk"),
    ({"local_disk": "s3://bucket"}, r"'local_disk'.*must be a directory path or a file:// URL"),
    ({"remote_serde": "cachegen"}, r"'remote_serde'.*unknown remote_serde 'cachegen'; supported: naive"),
    ({"remote_storage_plugins": ["hfbucket", "hfbucket"]}, r"lists hfbucket more than once"),
    ({"remote_storage_plugins": ["hfbucket."]}, r"'hfbucket\.' is not a plugin name; use 'type' or 'type"),
    ({"extra_config": ["a"]}, r"'extra_config'.*use a mapping"),
    ({"blocking_timeout_secs": 0}, r"'blocking_timeout_secs'.*greater than 0"),
    ({"local_cpu": True, "max_local_cpu_size": 0}, r"max_local_cpu_size is 0 GB; set it .* or set local_cpu"),
])
def test_config_errors(tmp_path: Path, data: dict[str, Any], expected: str) -> None:
    p = write(tmp_path, json.dumps(data))  # JSON is YAML
    with pytest.raises(ConfigError, match=expected):
        EngineConfig.from_file(p)


def test_env_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"'chunk_size'.*\(KVBUCKET_CHUNK_SIZE\).*got 'abc'"):
        load_engine_config(env={"KVBUCKET_CHUNK_SIZE": "abc"})
    with pytest.raises(ConfigError, match="KVBUCKET_EXTRA_CONFIG must be JSON"):
        load_engine_config(env={"KVBUCKET_EXTRA_CONFIG": "{nope"})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        EngineConfig.from_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        EngineConfig.from_file(write(tmp_path, "a: [1,"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        EngineConfig.from_file(write(tmp_path, "- 1\n- 2\n"))


def test_secret_values_never_appear_in_errors(tmp_path: Path) -> None:
    p = write(tmp_path, json.dumps({"extra_config": {"aws_secret_access_key": "SUPERSECRET99"}, "chunkk": 1}))
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_file(p)
    assert "SUPERSECRET99" not in str(e.value)


# ---- registry errors ---------------------------------------------------------------------------------


def test_plugin_key_for_unlisted_instance(fakes: FakeFactories) -> None:
    cfg = EngineConfig(remote_storage_plugins=["hfbucket.us"], extra_config={
        "remote_storage_plugin.hfbucket.eu.bucket_handle": "hf://buckets/a/eu",
    })
    expected = (r"'remote_storage_plugin.hfbucket.eu.bucket_handle' configures remote storage plugin "
                r"'hfbucket.eu', which is not listed.*add 'hfbucket.eu'")
    with pytest.raises(ConfigError, match=expected):
        build_backend(cfg, LAYOUT)


def test_extra_keys_nobody_takes() -> None:
    cfg = EngineConfig(extra_config={"s3_region": "us-east-1"})
    with pytest.raises(ConfigError, match=r"s3_region are not taken by any configured component.*remote_url"):
        build_backend(cfg, LAYOUT)


def test_factory_errors_propagate_and_nothing_leaks(fakes: FakeFactories) -> None:
    cfg = EngineConfig(remote_url="s3://bucket", remote_storage_plugins=["hfbucket"],
                       extra_config={"remote_storage_plugin.hfbucket.bogus": 1})
    with pytest.raises(ConfigError, match="bogus is not an hfbucket option"):
        build_backend(cfg, LAYOUT)
    assert fakes.url_calls == [("s3://bucket", {})]


def test_unknown_scheme_and_plugin_type() -> None:
    with pytest.raises(ConfigError, match=r"remote_url scheme 'redis' is not supported; use one of file://"):
        build_backend(EngineConfig(remote_url="redis://x"), LAYOUT)
    with pytest.raises(ConfigError, match=r"unknown type 'mooncake'; known types: hfbucket"):
        build_backend(EngineConfig(remote_storage_plugins=["mooncake"]), LAYOUT)


def test_missing_factory_module_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(plugins.URL_SCHEMES, "s3", "kvbucket.stores.does_not_exist:store_from_remote_url")
    with pytest.raises(ConfigError, match=r"the s3:// remote store is not available"):
        build_backend(EngineConfig(remote_url="s3://b"), LAYOUT)


def test_builtin_factories_validate_their_keys() -> None:
    with pytest.raises(ConfigError, match=r"s3_region are not options of the file:// remote store"):
        build_backend(EngineConfig(remote_url="/tmp/x", extra_config={"s3_region": "x"}), LAYOUT)
    with pytest.raises(ConfigError, match=r"are not options of the memory:// remote store"):
        build_backend(EngineConfig(remote_url="memory://x", extra_config={"fsync": True}), LAYOUT)


def test_layout_must_match_chunk_size() -> None:
    with pytest.raises(ConfigError, match=r"256 tokens per chunk but chunk_size is 512.*with_chunk_tokens"):
        build_backend(EngineConfig(chunk_size=512), LAYOUT)


def test_nothing_to_store_in() -> None:
    with pytest.raises(ConfigError, match="the config stores nothing"):
        build_backend(EngineConfig(local_cpu=False), LAYOUT)


@pytest.mark.parametrize(("written", "meant"), [("false", False), ("Off", False), (0, False), ("no", False),
                                                 (True, True), ("yes", True), (1, True), ("ON", True)])
def test_extra_config_metrics_is_a_lenient_boolean(tmp_path: Path, written: Any, meant: bool) -> None:
    """docs/backends.md: booleans are lenient like LMCache's in files and env vars, so
    ``extra_config.metrics: "false"`` or ``0`` turns the series off (an outside check found it refused)."""
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"extra_config": {"metrics": written}}))
    assert load_engine_config(path, env={}).metrics is meant
    env = {"KVBUCKET_EXTRA_CONFIG": json.dumps({"metrics": written})}
    assert load_engine_config(None, env=env).metrics is meant


@pytest.mark.parametrize("written", ["maybe", None, 0.5, [False]])
def test_extra_config_metrics_refuses_what_is_no_boolean(tmp_path: Path, written: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"extra_config": {"metrics": written}}))
    with pytest.raises(ConfigError, match="metrics must be true or false"):
        load_engine_config(path, env={})
