"""Blocking helpers over the submit-and-poll L2 interface, for tests and tools.

They wait on the adapter's event fds exactly as LMCache's controllers do (``poll`` then drain),
so a test using them also checks that completion is signalled.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence
from typing import Any

from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2Adapter, StoreResult


def lmcache_memory_obj(data: bytes) -> Any:
    """An LMCache ``TensorMemoryObj`` (KV_2LTD, uint8) holding a copy of ``data``, as LMCache's
    L1 hands to an L2 adapter; needs the lmcache extra (imported here, not at module load)."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    meta = MemoryObjMetadata(
        shape=torch.Size([len(data)]),
        dtype=torch.uint8,
        address=0,
        phy_size=len(data),
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(raw_data=tensor, metadata=meta, parent_allocator=None)


def drain_fd(fd: int) -> None:
    try:
        if hasattr(os, "eventfd_read"):
            os.eventfd_read(fd)
        else:  # pragma: no cover - pipe fallback
            while os.read(fd, 4096):
                pass
    except BlockingIOError:
        pass


def wait_fd(fd: int, timeout: float = 30.0) -> bool:
    """True when ``fd`` became readable within ``timeout`` (and drain it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(timeout * 1000):
        drain_fd(fd)
        return True
    return False


def fd_ready(fd: int) -> bool:
    """Whether ``fd`` is readable now, without draining it."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _wait(fetch: Any, fd: int, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = fetch()
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the L2 task did not complete in time")
        wait_fd(fd, left)


def store(
    adapter: L2Adapter, keys: Sequence[ObjectKey], buffers: Sequence[Any], timeout: float = 30.0
) -> StoreResult:
    tid = adapter.submit_store_task(keys, buffers)
    seen: dict[int, StoreResult] = {}

    def fetch() -> StoreResult | None:
        seen.update(adapter.pop_completed_store_tasks())
        return seen.pop(tid, None)

    return _wait(fetch, adapter.get_store_event_fd(), timeout)


def lookup(adapter: L2Adapter, keys: Sequence[ObjectKey], timeout: float = 30.0) -> list[bool]:
    tid = adapter.submit_lookup_and_lock_task(keys)
    return _wait(
        lambda: adapter.query_lookup_and_lock_result(tid), adapter.get_lookup_and_lock_event_fd(), timeout
    )


def load(
    adapter: L2Adapter, keys: Sequence[ObjectKey], buffers: Sequence[Any], timeout: float = 30.0
) -> list[bool]:
    tid = adapter.submit_load_task(keys, buffers)
    return _wait(lambda: adapter.query_load_result(tid), adapter.get_load_event_fd(), timeout)


__all__ = ["drain_fd", "fd_ready", "load", "lookup", "store", "wait_fd"]
