"""The non-MP S3 remote backend: BackendTests over RemoteBackend(S3Store) on SeaweedFS, and
``remote_url: s3://`` engine configs (the seed's YAMLs) building a working stack (the CoreWeave one
with ``enable_async_loading``, i.e. the pipelined remote backend)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.chunks import ChunkSizeError, KVLayout
from kvbucket.config import EngineConfig, build_backend
from kvbucket.errors import ConfigError
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.metrics import uninstrumented
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.backend_tests import BackendTests
from kvbucket.testing.s3_server import FaultProxy, S3Server
from kvbucket.testing.seed_configs import SEED_004_COREWEAVE, seed_config


class TestRemoteBackendOverS3(BackendTests):
    refuses_unfull_chunks = True
    supports_reopen = True

    @pytest.fixture
    def backend(self, seaweedfs: S3Server, s3_module_bucket: str,
                fresh_prefix: str) -> Iterator[StorageBackend]:
        # a fresh prefix in the module's bucket, not a bucket per test (s3_module_bucket)
        store = S3Store(S3Config.parse(seaweedfs.config(s3_module_bucket, fresh_prefix)))
        with RemoteBackend(store, self.layout, prefix="kv/llama") as b:
            yield b

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, RemoteBackend) and isinstance(backend.store.inner, S3Store)
        return RemoteBackend(S3Store(backend.store.inner.config), self.layout, prefix="kv/llama")


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, dtype="bfloat16", chunk_tokens=256)
KEYS = [CacheEngineKey("meta-llama/Llama-3.1-8B", 1, 0, h, "bfloat16") for h in (1, -2, 0xABC)]


def chunks() -> list[bytes]:
    return [
        np.random.default_rng(i).integers(0, 256, LAYOUT.full_chunk_bytes, dtype=np.uint8).tobytes()
        for i in range(len(KEYS))
    ]


def _round_trip(backend: StorageBackend) -> None:
    data = chunks()
    assert backend.batched_put(list(zip(KEYS, data, strict=True))) == len(KEYS)
    got = backend.batched_get(KEYS)
    assert [bytes(memoryview(g)) for g in got] == data
    assert all(backend.contains(k) for k in KEYS)
    with pytest.raises(ChunkSizeError, match="partial chunks"):
        backend.put(CacheEngineKey("m", 1, 0, 9, "bfloat16"), b"short")


def test_seed_basic_yaml_builds_a_working_stack(seaweedfs: S3Server, s3_bucket: str) -> None:
    cfg = EngineConfig.from_dict(
        {
            "chunk_size": 256,
            "local_cpu": False,
            "save_unfull_chunk": False,
            "remote_url": f"s3://{s3_bucket}",
            "remote_serde": "naive",
            "blocking_timeout_secs": 10,
            "extra_config": {
                "s3_region": "us-east-1",
                "s3_num_io_threads": 64,
                "save_chunk_meta": False,
                # the local server instead of AWS:
                "s3_endpoint_url": seaweedfs.endpoint_url,
                "aws_access_key_id": seaweedfs.access_key,
                "aws_secret_access_key": seaweedfs.secret_key,
            },
        }
    )
    with build_backend(cfg, LAYOUT) as backend:
        remote = uninstrumented(backend)
        assert isinstance(remote, RemoteBackend) and isinstance(uninstrumented(remote.store.inner), S3Store)
        assert remote.store.config.s3_retry_timeout_secs == 10
        _round_trip(backend)
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert sorted(keys) == sorted(key_to_name(k) for k in KEYS)  # same keys any S3 client sees


def test_seed_coreweave_yaml_builds_a_hybrid_stack(seaweedfs: S3Server, fault_proxy: FaultProxy) -> None:
    seaweedfs.create_bucket("test-127")
    try:
        cfg = EngineConfig.from_dict(
            seed_config(
                SEED_004_COREWEAVE,
                aws_access_key_id=seaweedfs.access_key,
                aws_secret_access_key=seaweedfs.secret_key,
                s3_proxy_url=fault_proxy.url,  # carries test-127.cwlota.com to the local server
            )
        )
        with build_backend(cfg, LAYOUT) as backend:
            assert isinstance(uninstrumented(backend), PipelinedRemoteBackend | HybridBackend)
            _round_trip(backend)
        assert fault_proxy.hosts and set(fault_proxy.hosts) == {"test-127.cwlota.com"}
    finally:
        seaweedfs.delete_bucket("test-127")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"s3_region": "us-east-1", "save_chunk_meta": True}, "save_chunk_meta must be false"),
        ({"s3_region": "us-east-1", "s3_num_thread": 3}, "s3_num_thread"),
        ({"s3_num_io_threads": 8}, "s3_region is required"),
    ],
)
def test_bad_s3_engine_configs(extra: dict[str, object], message: str) -> None:
    cfg = EngineConfig.from_dict({"chunk_size": 256, "remote_url": "s3://b", "extra_config": extra})
    with pytest.raises(ConfigError, match=message):
        build_backend(cfg, LAYOUT)


def test_save_unfull_chunk_is_refused_for_s3() -> None:
    cfg = EngineConfig.from_dict(
        {
            "chunk_size": 256,
            "remote_url": "s3://b",
            "save_unfull_chunk": True,
            "extra_config": {"s3_region": "us-east-1"},
        }
    )
    with pytest.raises(ConfigError, match="save_unfull_chunk must be false"):
        build_backend(cfg, LAYOUT)
