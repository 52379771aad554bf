"""HFBucketConfig and the plugin/URL factories: validation, precedence, errors a user can act on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbucket.errors import ConfigError
from kvbucket.stores import open_store
from kvbucket.stores.hub.config import (
    HFBucketConfig,
    build_config,
    config_from_plugin_options,
    default_download_tmp_dir,
    parse_bucket_handle,
)
from kvbucket.stores.hub.open import (
    open_hfbucket_store,
    store_from_plugin_options,
    store_from_remote_url,
)
from kvbucket.stores.hub.store import HFBucketStore

SECRET = "hf_unit_secret_value_123"
ENGINE = SimpleNamespace(save_unfull_chunk=False, extra_config={})


def test_handle_parsing_splits_namespace_bucket_prefix() -> None:
    loc = parse_bucket_handle("hf://buckets/my-org/lmcache-kv/prod/v1/")
    assert (loc.namespace, loc.bucket, loc.prefix) == ("my-org", "lmcache-kv", "prod/v1")
    assert loc.bucket_id == "my-org/lmcache-kv"
    assert loc.handle == "hf://buckets/my-org/lmcache-kv/prod/v1"
    assert parse_bucket_handle("hf://buckets/a/b").prefix == ""


@pytest.mark.parametrize(
    ("handle", "words"),
    [
        ("", "required"),
        ("s3://bucket/x", "must start with 'hf://buckets/'"),
        ("hf://my-org/kv", "did you mean hf://buckets/my-org/kv"),
        ("hf://buckets/only-namespace", "names no bucket"),
        ("hf://buckets/org//prefix", "names no bucket"),
        ("hf://buckets/-org/kv", "namespace '-org' is not a valid Hub name"),
        ("hf://buckets/org/kv..x", "bucket name 'kv..x' is not a valid Hub name"),
        ("hf://buckets/org/kv/../../etc", "invalid prefix"),
        ("hf://buckets/org/kv/a//b", "invalid prefix"),
        ("hf://buckets/org/kv?x=1", "must not contain '?'"),
    ],
)
def test_bad_handles_are_clear_errors(handle: str, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as ei:
        build_config(bucket_handle=handle)
    assert words in str(ei.value)


def test_defaults_match_seed_000() -> None:
    c = HFBucketConfig(bucket_handle="hf://buckets/o/b")
    assert c.token_env == "HF_TOKEN"
    assert c.token is None
    assert c.create_bucket_if_missing is False
    assert c.metadata_cache_ttl_secs == 30.0
    assert c.num_workers == 4
    assert c.resolved_tmp_dir() == default_download_tmp_dir()


def test_token_env_wins_over_token_and_token_never_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    c = HFBucketConfig(bucket_handle="hf://buckets/o/b", token=SECRET, token_env="KVB_TEST_TOKEN")
    monkeypatch.delenv("KVB_TEST_TOKEN", raising=False)
    assert c.resolved_token() == SECRET
    monkeypatch.setenv("KVB_TEST_TOKEN", "hf_from_env_456")
    assert c.resolved_token() == "hf_from_env_456"
    monkeypatch.setenv("KVB_TEST_TOKEN", "")
    assert c.resolved_token() == SECRET  # an empty variable does not count as set
    for text in (repr(c), str(c), c.model_dump_json(), repr(HFBucketStore(c))):
        assert SECRET not in text


def test_endpoint_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    c = HFBucketConfig(bucket_handle="hf://buckets/o/b")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    assert c.resolved_endpoint() == "http://127.0.0.1:9"
    c2 = HFBucketConfig(bucket_handle="hf://buckets/o/b", endpoint="http://10.0.0.1:8080/")
    assert c2.resolved_endpoint() == "http://10.0.0.1:8080"
    with pytest.raises(ConfigError, match="endpoint must be an http"):
        build_config(bucket_handle="hf://buckets/o/b", endpoint="ftp://x")


def test_strict_types_unknown_fields_and_token_not_echoed() -> None:
    with pytest.raises(ConfigError) as ei:
        build_config(bucket_handle="hf://buckets/o/b", create_bucket_if_missing="false")
    assert "create_bucket_if_missing" in str(ei.value)
    with pytest.raises(ConfigError, match="num_workers"):
        build_config(bucket_handle="hf://buckets/o/b", num_workers=0)
    with pytest.raises(ConfigError, match="metadata_cache_ttl_secs"):
        build_config(bucket_handle="hf://buckets/o/b", metadata_cache_ttl_secs=-1)
    with pytest.raises(ConfigError, match="metadata_cache_ttl_secs"):
        build_config(bucket_handle="hf://buckets/o/b", metadata_cache_ttl_secs="30")
    with pytest.raises(ConfigError) as ei:
        build_config(bucket_handle="hf://buckets/o/b", bucket_hadle="x")
    assert "unknown option 'bucket_hadle'" in str(ei.value) and "bucket_handle" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        build_config(bucket_handle="hf://buckets/o/b", token=[SECRET])
    assert SECRET not in str(ei.value)


def test_subclass_adds_fields_and_keeps_strictness() -> None:
    class L2Config(HFBucketConfig):
        max_capacity_gb: float = 0.0

    c = build_config(L2Config, bucket_handle="hf://buckets/o/b", max_capacity_gb=2)
    assert c.max_capacity_gb == 2.0 and c.bucket_id == "o/b"
    with pytest.raises(ConfigError, match="unknown option 'nope'"):
        build_config(L2Config, bucket_handle="hf://buckets/o/b", nope=1)
    store = HFBucketStore.from_config(c)
    assert store.url == "hf://buckets/o/b"
    store.close()


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("1", True), ("yes", True), ("ON", True),
                                               ("false", False), ("0", False), ("no", False), (True, True)])
def test_plugin_options_accept_lmcache_bools(raw: object, expected: bool) -> None:
    c = config_from_plugin_options("hfbucket", {"bucket_handle": "hf://buckets/o/b",
                                                "create_bucket_if_missing": raw})
    assert c.create_bucket_if_missing is expected


def test_plugin_options_seed_001_keys_and_errors() -> None:
    opts = {
        "bucket_handle": "hf://buckets/my-org/lmcache-kv/prod",
        "token_env": "HF_TOKEN",
        "create_bucket_if_missing": False,
        "download_tmp_dir": "/tmp/lmcache-hfbucket",
        "metadata_cache_ttl_secs": 30,
    }
    c = config_from_plugin_options("hfbucket", opts)
    assert c.prefix == "prod" and c.download_tmp_dir == "/tmp/lmcache-hfbucket"
    c = config_from_plugin_options("hfbucket.us", {**opts, "metadata_cache_ttl_secs": "12.5"})
    assert c.metadata_cache_ttl_secs == 12.5
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.hfbucket\.eu\.bucket_handle is required"):
        config_from_plugin_options("hfbucket.eu", {"token_env": "HF_EU_TOKEN"})
    with pytest.raises(ConfigError, match="maybe"):
        config_from_plugin_options("hfbucket", {**opts, "create_bucket_if_missing": "maybe"})
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.hfbucket: unknown option 'bucket'"):
        config_from_plugin_options("hfbucket", {**opts, "bucket": "x"})


def test_plugin_factory_refuses_partial_chunks_and_chunk_meta() -> None:
    opts = {"bucket_handle": "hf://buckets/o/b"}
    with pytest.raises(ConfigError, match="save_unfull_chunk: false"):
        store_from_plugin_options("hfbucket", opts, SimpleNamespace(save_unfull_chunk=True, extra_config={}))
    with pytest.raises(ConfigError, match="save_chunk_meta"):
        meta_on = SimpleNamespace(save_unfull_chunk=False, extra_config={"save_chunk_meta": "true"})
        store_from_plugin_options("hfbucket", opts, meta_on)
    store = store_from_plugin_options("hfbucket.us", opts, ENGINE)
    assert isinstance(store, HFBucketStore) and store.bucket_id == "o/b"
    store.close()


def test_remote_url_factory_and_opener() -> None:
    s = store_from_remote_url("hf://buckets/o/b/pfx", {"hfbucket.token_env": "MY_TOK"}, ENGINE)
    assert s.prefix == "pfx" and s.config.token_env == "MY_TOK"
    s.close()
    with pytest.raises(ConfigError, match="'chunk_thing'"):
        store_from_remote_url("hf://buckets/o/b", {"chunk_thing": 1}, ENGINE)
    s = open_store("hf://buckets/o/b/x", num_workers=2)
    assert isinstance(s, HFBucketStore) and s.config.num_workers == 2
    s.close()
    with pytest.raises(ConfigError, match="not both"):
        open_hfbucket_store("hf://buckets/o/b", bucket_handle="hf://buckets/o/c")


def test_plugin_options_take_every_number_quoted() -> None:
    """LMCache hands plugin options as strings: each number setting takes one (issue 39: the
    re-check settings were refused while load_timeout_secs was accepted)."""
    from kvbucket.stores.hub.config import HFBucketConfig

    numbers = [k for k, f in HFBucketConfig.model_fields.items() if f.annotation in (int, float)]
    assert {"recheck_delay_secs", "delete_window_secs", "load_timeout_secs"} <= set(numbers)
    for k in numbers:
        v = 3 if k == "delete_window_secs" else 7  # shorter than the default recheck_delay_secs
        v = 65536 if k in ("read_part_bytes", "read_min_part_bytes") else v  # 0 or at least 64 KiB
        c = config_from_plugin_options("hfbucket", {"bucket_handle": "hf://buckets/o/b", k: str(v)})
        assert getattr(c, k) == v, k
    c = config_from_plugin_options("hfbucket", {"bucket_handle": "hf://buckets/o/b",
                                                "recheck_delay_secs": " 10 ", "delete_window_secs": "3"})
    assert (c.recheck_delay_secs, c.delete_window_secs) == (10.0, 3.0)


@pytest.mark.parametrize("key", ["read_part_bytes", "read_min_part_bytes"])
def test_read_part_bytes_is_off_or_at_least_64_kib(key: str) -> None:
    """(tester case_hubcfg) read_part_bytes 1 read one object in a range per byte, past 40 s; the
    budget's floor (read_min_part_bytes) is held to the same range."""
    for value in (1, 4096, (64 << 10) - 1, True):
        with pytest.raises(ConfigError, match=key) as e:
            build_config(bucket_handle="hf://buckets/o/b", **{key: value})
        assert repr(value) in str(e.value) and ("65536 (64 KiB)" in str(e.value) or value is True)
    for value in (0, 64 << 10, 8 << 20):
        assert getattr(build_config(bucket_handle="hf://buckets/o/b", **{key: value}), key) == value
