"""The non-MP ``hfbucket`` remote plugin (seed 001) end to end on the emulator: the backend
conformance suite over RemoteBackend(HFBucketStore), and the seed's YAML configs built with
``build_backend`` (full chunks only, wrong-size objects refused, named instances, key listing)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import ChunkSizeError, KVLayout
from kvbucket.config import EngineConfig, build_backend
from kvbucket.envelope import HEADER_SIZE
from kvbucket.errors import ConfigError
from kvbucket.keys import key_to_name
from kvbucket.metrics import uninstrumented
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.backend_tests import BackendTests, as_bytes, chunk_bytes, key
from kvbucket.testing.seed_configs import SEED_001_MINIMAL, SEED_001_MULTI

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, dtype="bfloat16", chunk_tokens=256)

# Seed 001's YAMLs verbatim, but for the buckets (made per test) and the download directory.
SEED_001_SINGLE = SEED_001_MINIMAL.replace("my-org/lmcache-kv", "{bucket}").replace(
    "/tmp/lmcache-hfbucket", "{tmp}")
SEED_001_NAMED = "\nchunk_size: 256\nlocal_cpu: false" + SEED_001_MULTI.replace(
    "my-org/lmcache-kv/us", "{us}/us").replace("my-org/lmcache-kv/eu", "{eu}/eu")


def store_on(hub: Any, bucket_id: str, prefix: str) -> HFBucketStore:
    handle = f"hf://buckets/{bucket_id}/{prefix}"
    return HFBucketStore(build_config(bucket_handle=handle, token=hub.write_token, endpoint=hub.endpoint,
                                      token_env="", retry_backoff_secs=0.01))


class TestRemoteBackendOverHFBucket(BackendTests):
    refuses_unfull_chunks = True
    supports_reopen = True

    @pytest.fixture
    def backend(self, hub_bucket: Any) -> Iterator[StorageBackend]:
        with RemoteBackend(store_on(hub_bucket.hub, hub_bucket.bucket_id, "kv"), self.layout) as b:
            yield b

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, RemoteBackend) and isinstance(backend.store.inner, HFBucketStore)
        return RemoteBackend(HFBucketStore(backend.store.inner.config), self.layout)


def write_yaml(tmp_path: Path, text: str) -> EngineConfig:
    p = tmp_path / "lmcache.yaml"
    p.write_text(text)
    return EngineConfig.from_file(p)


@pytest.fixture
def hf_env(hub_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_ENDPOINT", hub_emulator.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_emulator.write_token)
    return hub_emulator


def test_seed_001_single_instance(hf_env: Any, hub_bucket: Any, tmp_path: Path) -> None:
    cfg = write_yaml(tmp_path, SEED_001_SINGLE.format(bucket=hub_bucket.bucket_id, tmp=tmp_path / "dl"))
    backend = build_backend(cfg, LAYOUT)
    remote = uninstrumented(backend)
    assert isinstance(remote, RemoteBackend) and isinstance(uninstrumented(remote.store.inner), HFBucketStore)
    full = LAYOUT.full_chunk_bytes
    with backend:
        chunks = {key(i): chunk_bytes(LAYOUT, i) for i in range(3)}
        assert backend.batched_put(list(chunks.items())) == 3
        assert [as_bytes(c) for c in backend.batched_get(list(chunks))] == list(chunks.values())
        assert sorted(backend.list()) == sorted(k.to_string() for k in chunks)  # key strings, not paths
        # a partial chunk is refused with a clear error, and not stored
        with pytest.raises(ChunkSizeError, match="refuse partial chunks"):
            backend.put(key(10), chunk_bytes(LAYOUT, 10, full // 2))
        assert not backend.contains(key(10))
        # an object of the wrong size under a key's name is refused on download
        odd = key(11)
        backend.store.put(key_to_name(odd), b"\x00" * (full - 2))
        assert backend.get(odd) is None and not backend.contains(odd)
        assert backend.remove(key(0)) and backend.get(key(0)) is None
    paths = {f.path for f in hf_env.api().list_bucket_tree(hub_bucket.bucket_id, recursive=True)
             if f.type == "file"}
    assert all(p.startswith("prod/") for p in paths) and len(paths) == 3


def test_seed_001_two_named_instances(hf_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = hf_env.api()
    us, eu = (f"{hf_env.namespace}/{r}-{uuid.uuid4().hex[:8]}" for r in ("us", "eu"))
    for b in (us, eu):
        api.create_bucket(b, private=True)
    monkeypatch.setenv("HF_US_TOKEN", hf_env.write_token)
    monkeypatch.setenv("HF_EU_TOKEN", hf_env.write_token)
    monkeypatch.delenv("HF_TOKEN")
    backend = build_backend(write_yaml(tmp_path, SEED_001_NAMED.format(us=us, eu=eu)), LAYOUT)
    assert isinstance(backend, HybridBackend)
    with backend:
        backend.put(key(1), chunk_bytes(LAYOUT, 1))
        assert as_bytes(backend.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert backend.list() == [key(1).to_string()]
    for bucket, prefix in ((us, "us/"), (eu, "eu/")):
        files = [f for f in api.list_bucket_tree(bucket, recursive=True) if f.type == "file"]
        assert len(files) == 1 and files[0].path.startswith(prefix)
        assert files[0].size == LAYOUT.full_chunk_bytes + HEADER_SIZE  # a sealed chunk


def test_partial_chunk_config_is_refused(hf_env: Any, hub_bucket: Any, tmp_path: Path) -> None:
    text = SEED_001_SINGLE.format(bucket=hub_bucket.bucket_id, tmp=tmp_path).replace(
        "save_unfull_chunk: false", "save_unfull_chunk: true")
    with pytest.raises(ConfigError, match="save_unfull_chunk: false"):
        build_backend(write_yaml(tmp_path, text), LAYOUT)


def test_unknown_plugin_option_is_named(hf_env: Any, hub_bucket: Any, tmp_path: Path) -> None:
    text = SEED_001_SINGLE.format(bucket=hub_bucket.bucket_id, tmp=tmp_path) + \
        "  remote_storage_plugin.hfbucket.metadata_cache_tll_secs: 5\n"
    with pytest.raises(ConfigError, match="metadata_cache_tll_secs"):
        build_backend(write_yaml(tmp_path, text), LAYOUT)


def test_remote_url_form(hf_env: Any, hub_bucket: Any) -> None:
    cfg = EngineConfig.from_dict({"local_cpu": False, "remote_url": f"hf://buckets/{hub_bucket.bucket_id}/url",
                                  "extra_config": {"hfbucket.metadata_cache_ttl_secs": 5}})
    with build_backend(cfg, LAYOUT) as backend:
        remote = uninstrumented(backend)
        assert isinstance(remote, RemoteBackend) and remote.store.config.metadata_cache_ttl_secs == 5
        backend.put(key(3), chunk_bytes(LAYOUT, 3))
        assert backend.contains(key(3))
