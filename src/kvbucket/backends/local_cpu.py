"""LocalCPUBackend: the hot tier, chunks kept in process memory, bounded by bytes, LRU."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvbucket.backends._putqueue import PutQueue
from kvbucket.backends._queued import BoundedLocalTier
from kvbucket.backends.base import Chunk, Key
from kvbucket.keys import as_key_string

# sys.getrefcount of a slab held only by the free list's caller: the local name + the argument.
_UNSHARED_REFS = 2


class LocalCPUBackend(BoundedLocalTier):
    """Chunks in an LRU dict, never more than ``max_bytes`` of chunk data accounted.

    A put copies the chunk once into a memory *slab* (the caller may reuse its buffer after a
    blocking put); a get hands back a read-only view of the slab without copying. Inserting
    beyond ``max_bytes`` evicts least-recently-used chunks first.

    Slabs of evicted or removed chunks are recycled for later puts of the same size, unless a
    reader still holds a view of them (checked by reference count), because touching fresh
    pages costs a page fault per 4 KiB: a full tier that recycles runs at memcpy speed, one
    that allocates runs at a fraction of it. Recycled slabs count against ``max_bytes`` too
    (``used_bytes + free_bytes <= max_bytes``), so the tier never holds more than its bound.

    Non-blocking puts go through a bounded queue drained by one worker thread; ``close()``
    drains it. ``peak_bytes`` records the most ever accounted, so tests can prove the bound held.
    """

    _TIER_NAME = "CPU"
    _SIZE_SETTING = "max_local_cpu_size"

    def __init__(
        self, max_bytes: int, *, queue_size: int = 64, on_evict: Callable[[str], None] | None = None
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"LocalCPUBackend needs a positive max_bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.free_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._chunks: OrderedDict[str, np.ndarray] = OrderedDict()
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._queue = PutQueue("cpu", self._apply, queue_size)
        self._closed = False
        self._on_evict = on_evict

    def __repr__(self) -> str:
        return f"LocalCPUBackend(max_bytes={self.max_bytes})"

    # ---- interface -----------------------------------------------------------------------
    def get(self, key: Key) -> Chunk | None:
        k = as_key_string(key)
        with self._lock:
            slab = self._chunks.get(k)
            if slab is not None:
                self._chunks.move_to_end(k)
                return memoryview(slab).toreadonly()
        pending = self._queue.pending(k)
        return None if pending is None else pending.toreadonly()

    def contains(self, key: Key) -> bool:
        k = as_key_string(key)
        with self._lock:
            if k in self._chunks:
                return True
        return self._queue.pending(k) is not None

    def remove(self, key: Key) -> bool:
        k = as_key_string(key)
        dropped = self._queue.cancel(k)
        with self._lock:
            slab = self._chunks.pop(k, None)
            if slab is not None:
                self.used_bytes -= slab.nbytes
                self._recycle(slab)
        return dropped or slab is not None

    def list(self) -> list[str]:
        with self._lock:
            keys = list(self._chunks)
        return self._with_pending(keys)

    # ---- internals -----------------------------------------------------------------------
    def _release(self) -> None:
        with self._lock:  # release the memory now; readers holding views keep their slabs alive
            self._chunks.clear()
            self._free.clear()
            self.used_bytes = self.free_bytes = 0

    def _apply(self, key: str, view: memoryview) -> None:
        self._insert(key, view)

    def _insert(self, key: str, view: memoryview) -> None:
        n = view.nbytes
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
                self._recycle(old)
            while self._chunks and self.used_bytes + n > self.max_bytes:
                vkey, victim = self._chunks.popitem(last=False)
                self.used_bytes -= victim.nbytes
                self.evictions += 1
                self._recycle(victim)
                if self._on_evict is not None:
                    self._on_evict(vkey)
            slab = self._take_free(n)
            self._trim_free(n)
            self.used_bytes += n  # reserved under the lock; the copy below needs no lock
            self.peak_bytes = max(self.peak_bytes, self.used_bytes + self.free_bytes)
        if slab is None:
            slab = np.empty(n, dtype=np.uint8)
        memoryview(slab)[:] = view
        with self._lock:
            self.used_bytes -= n
            old = self._chunks.pop(key, None)  # a concurrent put of the same key won the race
            if old is not None:
                self.used_bytes -= old.nbytes
                self._recycle(old)
            self._chunks[key] = slab
            self.used_bytes += n

    def _take_free(self, n: int) -> np.ndarray | None:
        slabs = self._free.get(n)
        if not slabs:
            return None
        self.free_bytes -= n
        return slabs.pop()

    def _trim_free(self, n: int) -> None:
        """Drop recycled slabs (any size) until ``n`` more bytes fit under the bound."""
        while self.free_bytes and self.used_bytes + self.free_bytes + n > self.max_bytes:
            size = next(s for s, slabs in self._free.items() if slabs)
            self._free[size].pop()
            self.free_bytes -= size

    def _recycle(self, slab: np.ndarray) -> None:
        # Only a slab nobody else can see may be written again (a reader may hold a view of it).
        if sys.getrefcount(slab) > _UNSHARED_REFS + 1:  # +1: the caller's own reference
            return
        if self.used_bytes + self.free_bytes + slab.nbytes > self.max_bytes:
            return
        self._free.setdefault(slab.nbytes, []).append(slab)
        self.free_bytes += slab.nbytes
