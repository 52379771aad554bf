"""The MP-mode L2 adapter interface, with LMCache's semantics and names.

An L2 adapter persists KV chunks for a cache server whose controller threads must never wait on
I/O. So every data verb is *submitted*: it returns a task id at once, the work runs elsewhere,
and completion is signalled on one of three event file descriptors (store, lookup-and-lock,
load) that the controller polls. Results are then fetched with one-shot queries (a second query
for the same id answers ``None``), exactly as LMCache's ``L2AdapterInterface`` does, so the
LMCache shim in :mod:`kvbucket.integrations.lmcache` is a thin translation.

Unlike LMCache, results are plain Python values (``list[bool]`` per key instead of a native
bitmap) and a store result says which keys landed, not just whether the whole task did.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvbucket.keys import ObjectKey
from kvbucket.stores.base import Buffer

L2TaskId = int

_HAS_EVENTFD = hasattr(os, "eventfd")


class EventNotifier:
    """A pollable completion signal: ``os.eventfd`` on Linux, a non-blocking pipe elsewhere.

    ``fileno()`` is what callers register with ``select.poll``; ``notify()`` makes it readable;
    ``consume()`` resets it. After ``close()`` notifications are dropped (the descriptor number
    may already belong to someone else, so writing to it would be a bug).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        if _HAS_EVENTFD:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._read_fd, self._write_fd = fd, fd
        else:  # pragma: no cover - non-Linux
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._read_fd, self._write_fd = r, w
        self._closed = False

    def fileno(self) -> int:
        return self._read_fd

    def notify(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                if _HAS_EVENTFD:
                    os.eventfd_write(self._write_fd, 1)
                else:  # pragma: no cover - non-Linux
                    os.write(self._write_fd, b"\x01")
            except BlockingIOError:  # counter/pipe full: it is readable already
                pass

    def consume(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                if _HAS_EVENTFD:
                    os.eventfd_read(self._read_fd)
                else:  # pragma: no cover - non-Linux
                    while os.read(self._read_fd, 4096):
                        pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            if self._write_fd != self._read_fd:  # pragma: no cover - non-Linux
                os.close(self._write_fd)

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass(frozen=True, slots=True)
class StoreResult:
    """The outcome of one store task.

    ``success`` is True only when every key landed. ``landed[i]`` says whether key i is in the
    store now (after a failed batch the store is asked, so a partial write is reported exactly).
    ``bytes_stored`` counts the bytes of the keys that landed.
    """

    success: bool
    bytes_stored: int
    landed: tuple[bool, ...] = ()

    @classmethod
    def failed(cls, n: int) -> StoreResult:
        return cls(False, 0, (False,) * n)


@dataclass(frozen=True, slots=True)
class Usage:
    """A snapshot of what an adapter holds. ``capacity_bytes`` 0 means no cap (no eviction)."""

    bytes_used: int
    capacity_bytes: int
    bytes_by_cache_salt: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: False while the startup listing is still running (``bytes_used`` is then a lower bound).
    complete: bool = True

    @property
    def usage_fraction(self) -> float:
        """``bytes_used / capacity_bytes``, or -1.0 when there is no capacity (LMCache's sentinel)."""
        if self.capacity_bytes <= 0:
            return -1.0
        return self.bytes_used / self.capacity_bytes


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of :meth:`L2Adapter.list_keys`. ``next_cursor`` None means the last page."""

    entries: tuple[tuple[ObjectKey, int], ...]
    next_cursor: str | None


class L2Adapter(abc.ABC):
    """Submit-and-poll persistence for KV chunks keyed by :class:`~kvbucket.keys.ObjectKey`.

    Thread-safe: LMCache calls it from a store controller and a prefetch controller at once.
    """

    # ---- completion signals (three distinct descriptors) ---------------------------------
    @abc.abstractmethod
    def get_store_event_fd(self) -> int: ...

    @abc.abstractmethod
    def get_lookup_and_lock_event_fd(self) -> int: ...

    @abc.abstractmethod
    def get_load_event_fd(self) -> int: ...

    # ---- store ----------------------------------------------------------------------------
    @abc.abstractmethod
    def submit_store_task(self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer]) -> L2TaskId:
        """Store ``buffers[i]`` under ``keys[i]``. Buffers must stay valid until completion."""

    @abc.abstractmethod
    def pop_completed_store_tasks(self) -> dict[L2TaskId, StoreResult]:
        """Every store task completed since the last call (each reported once)."""

    # ---- lookup and lock --------------------------------------------------------------------
    @abc.abstractmethod
    def submit_lookup_and_lock_task(self, keys: Sequence[ObjectKey], layout: Any | None = None) -> L2TaskId:
        """Find which keys are stored; each hit is locked (refcount +1) against delete/eviction.

        ``layout`` optionally gives the full chunk size in bytes: an int, or a dict from object
        group (``kv_rank >> 32``) to bytes. Objects of another size are misses.
        """

    @abc.abstractmethod
    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> list[bool] | None:
        """Per-key hits once, then None. None also while the task runs."""

    @abc.abstractmethod
    def submit_unlock(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one lock per key. Fire and forget; unlocking an unlocked key is a no-op."""

    # ---- load ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def submit_load_task(self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer]) -> L2TaskId:
        """Read each key into the caller's buffer. A stored size unlike the buffer's is a miss."""

    @abc.abstractmethod
    def query_load_result(self, task_id: L2TaskId) -> list[bool] | None:
        """Per-key success once, then None. None also while the task runs."""

    # ---- management -----------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Remove keys now (blocking). Locked keys are skipped; answers which keys were removed."""

    @abc.abstractmethod
    def get_usage(self) -> Usage: ...

    @abc.abstractmethod
    def list_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyPage: ...

    @abc.abstractmethod
    def report_status(self) -> dict[str, Any]:
        """Health and counters; always holds ``is_healthy``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop workers and close the event fds. Later submits complete at once as failed."""

    def __enter__(self) -> L2Adapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EventNotifier", "KeyPage", "L2Adapter", "L2TaskId", "StoreResult", "Usage"]
