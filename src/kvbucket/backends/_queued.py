"""What the tiers with a :class:`PutQueue` share: queued chunks served to ``batched_get_into``,
pending keys in ``list()``, ``flush``, ``close``, and (for the byte-bounded local tiers) the put
path with its whole-tier size check.

One place, so that a fix to the ordering of a put against queued puts, or to what ``close()``
drains first, reaches every tier at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbucket.backends._putqueue import PutQueue
from kvbucket.backends.base import (
    DEFAULT_FLUSH_TIMEOUT_SECS,
    Chunk,
    FlushResult,
    Key,
    StorageBackend,
    check_open,
    copy_chunk_into,
)
from kvbucket.chunks import ChunkSizeError, as_view
from kvbucket.keys import as_key_string


class QueuedBackend(StorageBackend):
    """A backend whose non-blocking puts wait in ``self._queue`` until its worker applies them."""

    _queue: PutQueue
    _closed: bool

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_SECS) -> FlushResult:
        """Wait for queued puts at most ``timeout`` seconds; true when every one landed."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Drain the queue first (queued puts land), then release the tier's own resources."""
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        self._release()

    def _release(self) -> None:
        """Free what the tier holds; called once, by ``close()``, after the queue has drained."""

    def _with_pending(self, keys: list[str]) -> list[str]:
        """``keys`` followed by the keys of queued puts not among them (still visible to reads)."""
        seen = set(keys)
        return keys + [k for k in self._queue.pending_keys() if k not in seen]

    def _copy_pending_into(self, ks: list[str], buffers: Sequence[Chunk]) -> tuple[list[bool], list[int]]:
        """Serve keys with a queued put (the newest data) into their buffers; the indexes of the
        other keys are returned for the tier to read."""
        out = [False] * len(ks)
        rest: list[int] = []
        for i, k in enumerate(ks):
            pending = self._queue.pending(k)
            if pending is not None:
                out[i] = copy_chunk_into(k, pending, as_view(buffers[i]))
            else:
                rest.append(i)
        return out, rest


class BoundedLocalTier(QueuedBackend):
    """A local tier of at most ``max_bytes``: a chunk larger than the whole tier is refused."""

    max_bytes: int
    _TIER_NAME: str  # in the error message: "CPU", "disk"
    _SIZE_SETTING: str  # the LMCache setting that raises the bound

    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        check_open(self, self._closed)
        k = as_key_string(key)
        view = as_view(chunk)
        self._check_fits(k, view.nbytes)
        if blocking:
            self._queue.cancel(k)  # a queued older put of k must not land after this one
            self._apply(k, view)
        else:
            self._queue.submit(k, view)

    def _check_fits(self, key: str, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise ChunkSizeError(
                f"chunk {key} is {nbytes} bytes, larger than the whole {self._TIER_NAME} tier "
                f"({self.max_bytes} bytes); raise {self._SIZE_SETTING}"
            )

    def _apply(self, key: str, view: memoryview) -> None:
        """Store ``view`` under ``key`` now (blocking puts, and the queue's worker)."""
        raise NotImplementedError
