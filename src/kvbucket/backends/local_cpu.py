"""LocalCPUBackend: the hot tier, chunks kept in process memory, bounded by bytes, LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from kvbucket.backends._putqueue import PutQueue
from kvbucket.backends.base import Chunk, Key, StorageBackend
from kvbucket.chunks import ChunkSizeError, as_view
from kvbucket.keys import as_key_string


class LocalCPUBackend(StorageBackend):
    """Chunks in an LRU dict, never more than ``max_bytes`` of chunk data accounted.

    A put copies the chunk once into an immutable ``bytes`` (the caller may reuse its buffer
    after a blocking put); a get hands that ``bytes`` back without copying. Inserting beyond
    ``max_bytes`` evicts least-recently-used chunks first. Non-blocking puts go through a
    bounded queue drained by one worker thread; ``close()`` drains it.

    ``peak_bytes`` records the most ever accounted, so tests can prove the bound held.
    """

    def __init__(
        self, max_bytes: int, *, queue_size: int = 64, on_evict: Callable[[str], None] | None = None
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"LocalCPUBackend needs a positive max_bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._chunks: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._queue = PutQueue("cpu", self._apply, queue_size)
        self._closed = False
        self._on_evict = on_evict

    def __repr__(self) -> str:
        return f"LocalCPUBackend(max_bytes={self.max_bytes})"

    # ---- interface -----------------------------------------------------------------------
    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        k = as_key_string(key)
        view = as_view(chunk)
        self._check_fits(k, view.nbytes)
        if blocking:
            self._queue.cancel(k)  # a queued older put of k must not land after this one
            self._insert(k, bytes(view))
        else:
            self._queue.submit(k, view)

    def get(self, key: Key) -> Chunk | None:
        k = as_key_string(key)
        with self._lock:
            data = self._chunks.get(k)
            if data is not None:
                self._chunks.move_to_end(k)
                return data
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
            data = self._chunks.pop(k, None)
            if data is not None:
                self.used_bytes -= len(data)
        return dropped or data is not None

    def list(self) -> list[str]:
        with self._lock:
            keys = list(self._chunks)
        seen = set(keys)
        return keys + [k for k in self._queue.pending_keys() if k not in seen]

    def flush(self) -> None:
        self._queue.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close()

    # ---- internals -----------------------------------------------------------------------
    def _check_fits(self, key: str, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise ChunkSizeError(
                f"chunk {key} is {nbytes} bytes, larger than the whole CPU tier ({self.max_bytes} bytes); "
                "raise max_local_cpu_size"
            )

    def _apply(self, key: str, view: memoryview) -> None:
        self._insert(key, bytes(view))

    def _insert(self, key: str, data: bytes) -> None:
        n = len(data)
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self._chunks and self.used_bytes + n > self.max_bytes:
                vkey, victim = self._chunks.popitem(last=False)
                self.used_bytes -= len(victim)
                self.evictions += 1
                if self._on_evict is not None:
                    self._on_evict(vkey)
            self._chunks[key] = data
            self.used_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
