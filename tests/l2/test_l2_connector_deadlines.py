"""LMCache's non-MP connector (``KVBucketConnector``) over a hung store: its lookups
(``exists``, ``batched_contains``) and the lookup part of its reads answer "miss" within the
store's lookup deadline, never an exception, and at once once the store's breaker is open
(docs/reliability.md)."""

from __future__ import annotations

import statistics
import time

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey

from kvbucket.integrations.lmcache import KVBucketConnector
from kvbucket.stores.breaker import OPEN
from kvbucket.stores.hfbucket import HFBucketStore
from kvbucket.stores.hfbucket_config import build_config
from kvbucket.testing.silent_server import SilentServer

pytestmark = pytest.mark.lmcache


def test_connector_lookups_on_a_hung_store_miss_within_the_deadline_then_at_once() -> None:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["kvbucket"],
        extra_config={
            "remote_storage_plugin.kvbucket.module_path": "kvbucket.integrations.lmcache",
            "remote_storage_plugin.kvbucket.class_name": "KVBucketConnector",
            "remote_storage_plugin.kvbucket.bucket_handle": "hf://buckets/o/b",
        },
    )
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8), chunk_size=16)
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in range(1, 40)]
    with SilentServer() as server:
        # Default lookup and load deadlines (1 s, 5 s); the breaker opens after 3 failed calls.
        store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b", token="hf_x", token_env="",
                                           endpoint=server.url, request_timeout_secs=1, breaker_failures=3,
                                           breaker_cooldown_secs=600))
        conn = KVBucketConnector(None, cpu, cfg, md, plugin_name="kvbucket", store=store)
        try:
            t0 = time.monotonic()
            assert conn.exists_sync(keys[0]) is False  # was: DeadlineExceededError
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert conn.batched_contains(keys[1:3]) == 0
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert conn._batched_get_sync([keys[3]]) == [None]  # its lookup failed: no load after it
            assert time.monotonic() - t0 < 2.0  # the lookup deadline, not lookup + load (6 s)
            assert store.breaker.state is OPEN and conn.lookup_failures >= 4
            times = []
            for k in keys[4:]:
                t0 = time.perf_counter()
                assert conn.exists_sync(k) is False
                times.append(time.perf_counter() - t0)
            assert statistics.median(times) < 0.001  # the open breaker answers without the network
        finally:
            store.close()
            conn.store.close()
