"""The storage-backend interface (seed 002): chunk tiers keyed by :class:`CacheEngineKey`.

A *chunk* is the KV cache of one run of tokens, as one contiguous bytes-like buffer (bytes,
memoryview, numpy array, or a CPU torch tensor when torch is installed). Backends return
chunks as read-only bytes-like objects (``bytes`` or ``memoryview``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvbucket.errors import KVBucketError
from kvbucket.keys import CacheEngineKey
from kvbucket.log_once import RepeatedLog

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count

Chunk: TypeAlias = Any  # a bytes-like buffer; see kvbucket.chunks.as_view
Key: TypeAlias = CacheEngineKey | str

#: How long ``flush()`` waits for queued puts unless given a timeout.
DEFAULT_FLUSH_TIMEOUT_SECS = 30.0


@dataclass(frozen=True)
class FlushResult:
    """What a ``flush()`` saw of the non-blocking puts issued before it.

    ``pending``: not finished when the timeout passed (still queued or being applied; they may
    land later, and ``close()`` drops what cannot land in time). ``failed``: finished by failing
    since the previous flush (each logged). True only when both are zero: every put landed.
    """

    pending: int = 0
    failed: int = 0

    def __bool__(self) -> bool:
        return self.pending == 0 and self.failed == 0

    def __add__(self, other: FlushResult) -> FlushResult:
        return FlushResult(self.pending + other.pending, self.failed + other.failed)


class StorageBackend(abc.ABC):
    """put / get / contains / batched_put / batched_get / remove / list / close."""

    @abc.abstractmethod
    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        """Store one chunk. With ``blocking=False`` the call may return before it lands."""

    @abc.abstractmethod
    def get(self, key: Key) -> Chunk | None:
        """The chunk stored under ``key``, or None."""

    @abc.abstractmethod
    def contains(self, key: Key) -> bool:
        """Whether ``key`` is stored (and, for remote tiers, usable: a full chunk)."""

    @abc.abstractmethod
    def remove(self, key: Key) -> bool:
        """Remove ``key``; True when something was removed."""

    @abc.abstractmethod
    def list(self) -> list[str]:
        """Key strings of every stored chunk."""

    def batched_put(self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True) -> int:
        """Store many chunks; returns how many were stored (or accepted, when non-blocking).

        Items that fail are not counted and are logged with their reason; use
        :meth:`batched_put_results` to get the reason of each item.
        """
        items = list(items)
        results = self.batched_put_results(items, blocking=blocking)
        for (key, _), err in zip(items, results, strict=True):
            if err is not None:
                _repeated.warning("%s: put of %s failed: %s", type(self).__name__, key, err, item=key)
        return sum(1 for r in results if r is None)

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        """Per-item outcome of a batch put, in input order: None when stored (or accepted)."""
        out: list[Exception | None] = []
        for key, chunk in items:
            try:
                self.put(key, chunk, blocking=blocking)
            except BackendClosedError:
                raise  # the whole call is unusable, as with a closed store
            except Exception as e:
                out.append(e)
                continue
            out.append(None)
        return out

    def batched_contains(self, keys: Sequence[Key]) -> list[bool]:
        """``contains`` for many keys; remote tiers answer with one request per batch."""
        return [self.contains(k) for k in keys]

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        return [self.get(k) for k in keys]

    def get_into(self, key: Key, buffer: Chunk) -> bool:
        """Read the chunk into ``buffer`` (writable, exactly the chunk's size); False on a miss."""
        return self.batched_get_into([key], [buffer])[0]

    def batched_get_into(self, keys: Sequence[Key], buffers: Sequence[Chunk]) -> list[bool]:
        """Read chunks into caller buffers, as an engine fills its own KV memory.

        Tiers that can read straight into the buffer (files, remote stores) override this to
        skip the intermediate copy. A stored chunk whose size differs from its buffer is a miss
        (logged) and the buffer is left untouched.
        """
        from kvbucket.chunks import as_view

        check_buffers(keys, buffers)
        out: list[bool] = []
        for key, buf, chunk in zip(keys, buffers, self.batched_get(keys), strict=True):
            if chunk is None:
                out.append(False)
                continue
            out.append(copy_chunk_into(key, chunk, as_view(buf)))
        return out

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_SECS) -> FlushResult:
        """Wait until every non-blocking put issued so far has finished, at most ``timeout``
        seconds (None: no bound). The answer is true only when every one of them landed; it
        counts those still pending at the timeout and those that failed (see :class:`FlushResult`).
        Tiers without a put queue have nothing to wait for."""
        return FlushResult()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush pending work and release resources. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BackendClosedError(KVBucketError, RuntimeError):
    """A put reached a backend after ``close()``: it would be lost, so it is refused."""


def check_open(backend: StorageBackend, closed: bool) -> None:
    if closed:
        raise BackendClosedError(f"{type(backend).__name__} is closed; it accepts no more puts")


def check_buffers(keys: Sequence[Key], buffers: Sequence[Chunk]) -> None:
    """``batched_get_into`` needs one buffer per key."""
    if len(keys) != len(buffers):
        raise ValueError(f"batched_get_into got {len(keys)} keys but {len(buffers)} buffers")


def put_as_batch(backend: StorageBackend, key: Key, chunk: Chunk, blocking: bool) -> None:
    """``put`` for tiers whose batch put is the primitive: the one item's error is raised."""
    (err,) = backend.batched_put_results([(key, chunk)], blocking=blocking)
    if err is not None:
        raise err


def copy_chunk_into(key: Key, chunk: Chunk, dst: memoryview) -> bool:
    """Copy ``chunk`` into ``dst`` when the sizes agree; log and return False when not."""
    from kvbucket.chunks import as_view

    if dst.readonly:
        raise ValueError(f"the buffer given for {key} is read-only")
    src = as_view(chunk)
    if src.nbytes != dst.nbytes:
        log.warning("chunk %s is %d bytes but its buffer holds %d; treated as a miss", key, src.nbytes,
                    dst.nbytes)
        return False
    dst[:] = src
    return True


__all__ = [
    "DEFAULT_FLUSH_TIMEOUT_SECS", "BackendClosedError", "Chunk", "FlushResult", "Key", "StorageBackend",
    "check_buffers", "check_open", "copy_chunk_into", "put_as_batch",
]
