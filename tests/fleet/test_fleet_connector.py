"""LMCache's non-MP connector as a fleet member: two connectors on one prefix share its capacity.

Real LMCache 0.5.6 objects (engine config, metadata, LocalCPUBackend memory objects) drive
kvbucket's ``KVBucketConnector`` on an ``fs`` prefix; the fleet runs with fast timings.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey

from kvbucket.errors import ConfigError, StoreError
from kvbucket.integrations.lmcache import KVBucketConnector
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.lmcache_engine import connector as lmcache_connector

CHUNK_TOKENS = 16
CHUNK = 2 * 2 * CHUNK_TOKENS * 2 * 8 * 2  # kv_shape (2, 2, 16, 2, 8) in bf16: 2 KiB
CAPACITY = 32 * CHUNK
FLEET = {"sync_secs": 0.2, "heartbeat_secs": 0.5, "node_timeout_secs": 3.0, "compact_secs": 1.0,
         "grace_secs": 0.3}


def connector(root: Path, loop: asyncio.AbstractEventLoop, **extra: Any) -> KVBucketConnector:
    conn: KVBucketConnector = lmcache_connector(loop, {"bucket_handle": f"file://{root}", **extra},
                                                chunk_tokens=CHUNK_TOKENS)
    return conn


def put(conn: KVBucketConnector, loop: asyncio.AbstractEventLoop, hashes: range) -> int:
    """Store one chunk per hash, a few per batch; returns how many the fleet accepted."""
    from lmcache.v1.memory_management import MemoryFormat

    stored = 0
    for start in range(hashes.start, hashes.stop, 4):
        keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in range(start, start + 4)]
        objs = [conn.local_cpu_backend.allocate(conn.meta_shapes, conn.meta_dtypes, MemoryFormat.KV_2LTD)
                for _ in keys]
        refused = conn._fleet.status()["refused_chunks"]  # type: ignore[union-attr]
        try:
            asyncio.run_coroutine_threadsafe(conn.batched_put(keys, objs), loop).result(20)
        except StoreError as e:
            assert "write cap" in str(e)
        stored += len(keys) - (conn._fleet.status()["refused_chunks"] - refused)  # type: ignore[union-attr]
        for o in objs:
            o.ref_count_down()
        time.sleep(0.05)
    return stored


def chunk_bytes(root: Path) -> int:
    with FileStore(root) as s:
        return sum(i.size for i in s.list("") if not i.name.startswith("_fleet/"))


def test_two_connectors_writing_3x_capacity_settle_under_it(tmp_path: Path, lm_loop: Any) -> None:
    root = tmp_path / "kv"
    spec = {"max_capacity_gb": CAPACITY / 1024**3}
    a = connector(root, lm_loop, **spec, fleet={**FLEET, "node_id": "a"})
    b = connector(root, lm_loop, **spec, fleet={**FLEET, "node_id": "b"})
    try:
        assert a.full_chunk_size_bytes == CHUNK
        per_node = 3 * CAPACITY // CHUNK // 2
        done = [0, 0]
        work = [(a, range(0, per_node)), (b, range(10_000, 10_000 + per_node))]
        threads = [threading.Thread(target=lambda i=i, c=c, r=r: done.__setitem__(i, put(c, lm_loop, r)))
                   for i, (c, r) in enumerate(work)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        end = time.monotonic() + 10
        while chunk_bytes(root) > 1.1 * CAPACITY and time.monotonic() < end:
            time.sleep(0.2)
        # The envelope adds a few bytes per object on disk; the fleet counts payloads.
        assert chunk_bytes(root) <= 1.1 * CAPACITY * 1.05, chunk_bytes(root) / CAPACITY
        fa, fb = a._fleet.status(), b._fleet.status()  # type: ignore[union-attr]
        assert set(fa["live_nodes"]) == {"a", "b"}
        assert fa["evicted_own"] + fa["evicted_cross_node"] + fb["evicted_own"] + fb["evicted_cross_node"] > 0
        assert sum(done) + fa["refused_chunks"] + fb["refused_chunks"] == 2 * per_node
        # What a connector believes is stored is there: a survivor loads, an evicted one misses.
        survivors = [h for h in range(per_node)
                     if a.exists_sync(CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16))]
        assert survivors
        got = asyncio.run_coroutine_threadsafe(
            b.get(CacheEngineKey("org/llama", 1, 0, survivors[-1], torch.bfloat16)), lm_loop).result(20)
        assert got is not None
        got.ref_count_down()
    finally:
        for c in (a, b):
            asyncio.run_coroutine_threadsafe(c.close(), lm_loop).result(20)


def test_a_capacity_without_a_fleet_is_refused(tmp_path: Path, lm_loop: Any) -> None:
    with pytest.raises(ConfigError, match="fleet"):
        connector(tmp_path / "kv", lm_loop, max_capacity_gb=1.0)
