"""LMCache 0.5.6's L2 adapter contract, point by point, checked against the real lmcache.

Where a point can be observed on one of LMCache's own adapters without a server (its ``fs``
adapter), the same scenario runs on LMCache's adapter and on kvbucket's plugin and both must
behave alike. The other points follow LMCache's documentation and its hfbucket/s3 adapters'
code (cited per test; see docs/l2.md "LMCache's adapter contract").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

from kvbucket.integrations.lmcache import KVBucketConnector, KVBucketL2Adapter
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.l2 import drain_fd, lmcache_memory_obj, wait_fd

pytestmark = pytest.mark.lmcache


def lmkey(i: int, salt: str = "") -> LMKey:
    return LMKey(chunk_hash=i.to_bytes(16, "big"), model_name="org/llama", kv_rank=0x01000100,
                 object_group_id=0, cache_salt=salt)  # fmt: skip


class Recorder:
    """An L2AdapterListener that records events with what the event fds showed at that time."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.events: list[tuple[str, list[LMKey], Any]] = []

    def on_l2_keys_stored(self, keys: list[LMKey], sizes: list[int]) -> None:
        self.events.append(("stored", list(keys), list(sizes)))

    def on_l2_keys_accessed(self, keys: list[LMKey]) -> None:
        self.events.append(("accessed", list(keys), None))

    def on_l2_keys_deleted(self, keys: list[LMKey]) -> None:
        self.events.append(("deleted", list(keys), None))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


def _lmcache_fs(path: Path) -> Any:
    return FSL2Adapter(FSL2AdapterConfig(base_path=str(path)))


def _kvbucket_fs(path: Path) -> Any:
    a = KVBucketL2Adapter({"type": "fs", "base_path": str(path)})
    assert a.impl.wait_until_rebuilt(10)  # objects the startup listing finds are not "stored" events
    return a


BOTH: dict[str, Callable[[Path], Any]] = {"lmcache-fs": _lmcache_fs, "kvbucket-fs": _kvbucket_fs}


@pytest.fixture(params=list(BOTH))
def fs_adapter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    adapter = BOTH[request.param](tmp_path / "kv")
    yield adapter
    adapter.close()


def _store(adapter: Any, keys: list[LMKey], objs: list[Any]) -> Any:
    tid = adapter.submit_store_task(keys, objs)
    assert wait_fd(adapter.get_store_event_fd())
    drain_fd(adapter.get_store_event_fd())
    return adapter.pop_completed_store_tasks()[tid]


def test_one_store_task_takes_mixed_sizes_like_lmcache_fs(fs_adapter: Any) -> None:
    keys = [lmkey(1), lmkey(2)]
    res = _store(fs_adapter, keys, [lmcache_memory_obj(b"a" * 100), lmcache_memory_obj(b"b" * 40)])
    assert res.is_successful() and res.bytes_transferred() == 140
    tid = fs_adapter.submit_lookup_and_lock_task(keys, {})
    assert wait_fd(fs_adapter.get_lookup_and_lock_event_fd())
    assert fs_adapter.query_lookup_and_lock_result(tid).get_indices_list() == [0, 1]
    outs = [lmcache_memory_obj(bytes(100)), lmcache_memory_obj(bytes(40))]
    tid = fs_adapter.submit_load_task(keys, outs)
    assert wait_fd(fs_adapter.get_load_event_fd())
    assert fs_adapter.query_load_result(tid).get_indices_list() == [0, 1]
    assert bytes(outs[0].byte_array) == b"a" * 100 and bytes(outs[1].byte_array) == b"b" * 40


def test_stored_listener_runs_before_the_store_signal(fs_adapter: Any) -> None:
    """LMCache's fs, hfbucket and s3 adapters call ``_notify_keys_stored`` before
    ``_store_efd.notify()``: a controller woken by the signal finds its listener told."""
    rec = Recorder(fs_adapter)
    fs_adapter.register_listener(rec)
    seen_at_signal: list[list[str]] = []
    fd = fs_adapter.get_store_event_fd()

    def watch() -> None:
        if wait_fd(fd, 30):
            seen_at_signal.append(rec.kinds())

    for i in range(5):  # the race is intermittent when the order is wrong: try a few times
        rec.events.clear()
        seen_at_signal.clear()
        th = threading.Thread(target=watch)
        th.start()
        tid = fs_adapter.submit_store_task([lmkey(10 + i)], [lmcache_memory_obj(bytes([i]) * 64)])
        th.join(30)
        drain_fd(fd)
        assert fs_adapter.pop_completed_store_tasks()[tid].is_successful()
        assert seen_at_signal == [["stored"]]


def test_accessed_fires_on_a_lookup_hit(tmp_path: Path) -> None:
    """``L2AdapterListener.on_l2_keys_accessed``: "keys have been accessed (lookup hit)", which is
    where LMCache's hfbucket and s3 adapters call it (right after the lookup signal); a load does
    not fire it again."""
    a = _kvbucket_fs(tmp_path / "kv")
    try:
        rec = Recorder(a)
        a.register_listener(rec)
        _store(a, [lmkey(1)], [lmcache_memory_obj(b"x" * 64)])
        tid = a.submit_lookup_and_lock_task([lmkey(1), lmkey(2)], {})
        assert wait_fd(a.get_lookup_and_lock_event_fd())
        assert a.query_lookup_and_lock_result(tid).get_indices_list() == [0]
        deadline = time.monotonic() + 10
        while len(rec.events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.kinds() == ["stored", "accessed"] and rec.events[1][1] == [lmkey(1)]
        out = lmcache_memory_obj(bytes(64))
        tid = a.submit_load_task([lmkey(1)], [out])
        assert wait_fd(a.get_load_event_fd())
        assert a.query_load_result(tid).get_indices_list() == [0]
        assert rec.kinds() == ["stored", "accessed"]
    finally:
        a.close()


def test_delete_of_a_missing_key_notifies_with_size_zero(tmp_path: Path) -> None:
    """LMCache's s3 and hfbucket adapters report every deleted key, one never stored included,
    "with size 0 so listener fanout still fires while byte accounting stays balanced"
    (``S3L2Adapter._execute_delete``); locked keys are skipped and not reported."""
    a = _kvbucket_fs(tmp_path / "kv")
    try:
        rec = Recorder(a)
        a.register_listener(rec)
        _store(a, [lmkey(1), lmkey(3)], [lmcache_memory_obj(b"x" * 64), lmcache_memory_obj(b"y" * 64)])
        tid = a.submit_lookup_and_lock_task([lmkey(3)], {})  # locks key 3
        assert wait_fd(a.get_lookup_and_lock_event_fd())
        assert a.query_lookup_and_lock_result(tid).get_indices_list() == [0]
        rec.events.clear()
        a.delete([lmkey(1), lmkey(2), lmkey(3)])
        assert rec.kinds() == ["deleted"] and rec.events[0][1] == [lmkey(1), lmkey(2)]
        assert a.get_usage().total_bytes_used == 64  # key 3, still there
    finally:
        a.close()


def test_download_tmp_dir_is_made_and_removed_on_close(hub_bucket: HubBucket, tmp_path: Path) -> None:
    """LMCache's hfbucket adapter creates ``download_tmp_dir`` (with parents) and a session dir
    ``hfbucket-mp-*`` in it, and removes the session dir on close."""
    root = tmp_path / "dl" / "nested"
    a = KVBucketL2Adapter({"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}",
                           "token": hub_bucket.hub.write_token, "endpoint": hub_bucket.hub.endpoint,
                           "download_tmp_dir": str(root)})  # fmt: skip
    try:
        sessions = list(root.iterdir())
        assert [p.name.startswith("hfbucket-mp-") and p.is_dir() for p in sessions] == [True]
    finally:
        a.close()
    assert root.is_dir() and list(root.iterdir()) == []


# ---- non-MP connector -------------------------------------------------------------------------
def _connector(tmp_path: Path, loop: asyncio.AbstractEventLoop, extra: dict[str, Any]) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["kv"],
        extra_config={"remote_storage_plugin.kv.module_path": "kvbucket.integrations.lmcache",
                      "remote_storage_plugin.kv.class_name": "KVBucketConnector",
                      **{f"remote_storage_plugin.kv.{k}": v for k, v in extra.items()}},
    )  # fmt: skip
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8),
                         chunk_size=16)  # fmt: skip
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    return KVBucketConnector(loop=loop, local_cpu_backend=cpu, config=cfg)


def test_connector_put_of_a_partial_chunk_raises_value_error(tmp_path: Path, lm_loop: Any) -> None:
    """LMCache's hfbucket connector raises ``ValueError`` ("Partial/unfull chunks are not
    supported") for a chunk whose size is not the full chunk, before uploading anything."""
    from lmcache.v1.memory_management import MemoryFormat

    conn = _connector(tmp_path, lm_loop, {"bucket_handle": f"file://{tmp_path / 'kv'}"})
    cpu = conn.local_cpu_backend
    full = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, MemoryFormat.KV_2LTD)
    part_shape = [torch.Size([2, 2, 8, 16])]
    part = cpu.allocate(part_shape, conn.meta_dtypes, MemoryFormat.KV_2LTD)
    assert part.get_size() != conn.full_chunk_size_bytes == full.get_size()
    keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in (1, 2)]
    with pytest.raises(ValueError, match="Partial/unfull chunks are not supported"):
        asyncio.run_coroutine_threadsafe(conn.batched_put(keys, [full, part]), lm_loop).result(20)
    assert list(conn.store.list()) == []  # nothing of the batch was written
    asyncio.run_coroutine_threadsafe(conn.put(keys[0], full), lm_loop).result(20)
    assert conn.exists_sync(keys[0])
    asyncio.run_coroutine_threadsafe(conn.close(), lm_loop).result(20)


def test_connector_download_tmp_dir_is_made_and_removed_on_close(
    hub_bucket: HubBucket, tmp_path: Path, lm_loop: Any
) -> None:
    """LMCache's hfbucket connector makes ``hfbucket-<plugin>-*`` in ``download_tmp_dir`` and
    removes it on close."""
    root = tmp_path / "dl"
    conn = _connector(tmp_path, lm_loop, {"bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}",
                                          "token": hub_bucket.hub.write_token,
                                          "endpoint": hub_bucket.hub.endpoint,
                                          "download_tmp_dir": str(root)})  # fmt: skip
    assert [p.name.startswith("hfbucket-kv-") for p in root.iterdir()] == [True]
    asyncio.run_coroutine_threadsafe(conn.close(), lm_loop).result(20)
    assert list(root.iterdir()) == []
