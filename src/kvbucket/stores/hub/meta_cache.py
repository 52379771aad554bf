"""A TTL cache of exact object metadata (present with size/hash, or known missing).

Remote lookups dominate the cost of a cache hit check; LMCache's connectors cache sizes for a
TTL too. Entries come only from the remote's own answers or from this process's acknowledged
writes and deletes, so a cached answer is at most ``ttl`` seconds older than the truth.

A cached answer never replaces a newer write's: a remote answer can arrive after a put or delete
of the same key returned (the server answered before the write committed), so a lookup takes a
``stamp()`` before it asks and ``set_many(..., since=stamp)`` skips every key this process wrote
since then (``written`` at a write's start and when its outcome is unknown, ``set_written`` when
it is acknowledged).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

V = TypeVar("V")

_MISSING = object()
_PRUNE_EVERY = 4096
_WRITES_KEPT = 65536  # per-key write epochs kept; past this they are dropped and older stamps refused


class MetaCache(Generic[V]):
    """``key -> V | None`` (None = known missing) with one TTL; thread-safe; ttl <= 0 disables it."""

    def __init__(self, ttl_secs: float) -> None:
        self.ttl = float(ttl_secs)
        self._d: dict[str, tuple[float, V | None]] = {}
        self._lock = threading.Lock()
        self._writes = 0
        self._epoch = 0  # bumped by every write this process records
        self._written: dict[str, int] = {}  # key -> epoch of its last recorded write
        self._floor = 0  # stamps older than this cannot be checked (their epochs were dropped)
        self.hits = 0  # fresh answers served (for stats and tests)

    def get_many(self, keys: Iterable[str]) -> dict[str, V | None]:
        """Fresh entries among ``keys`` (absent from the result = unknown, ask the remote)."""
        if self.ttl <= 0:
            return {}
        now = time.monotonic()
        out: dict[str, V | None] = {}
        with self._lock:
            for k in keys:
                e = self._d.get(k)
                if e is not None and e[0] > now:
                    out[k] = e[1]
            self.hits += len(out)
        return out

    def stamp(self) -> int:
        """Take before asking the remote; pass to ``set_many`` with its answer."""
        with self._lock:
            return self._epoch

    def set_many(self, items: Iterable[tuple[str, V | None]], *, since: int | None = None) -> None:
        """Cache remote answers; with ``since`` (a ``stamp()``), skip keys written after it."""
        if self.ttl <= 0:
            return
        with self._lock:
            if since is not None and since < self._floor:
                return  # the writes since then are no longer known: cache nothing
            self._set(items, since)

    def set_written(self, items: Iterable[tuple[str, V | None]]) -> None:
        """A write or delete this process made was acknowledged: this is the newest state."""
        items = list(items)
        with self._lock:
            self._bump([k for k, _ in items])
            if self.ttl > 0:
                self._set(items, None)

    def written(self, keys: Iterable[str]) -> None:
        """A write of ``keys`` starts, or ended with an unknown outcome: drop them, refuse older answers."""
        keys = list(keys)
        with self._lock:
            self._bump(keys)
            for k in keys:
                self._d.pop(k, None)

    def _bump(self, keys: list[str]) -> None:  # under the lock
        self._epoch += 1
        if len(self._written) + len(keys) > _WRITES_KEPT:
            self._written.clear()
            self._floor = self._epoch
        for k in keys:
            self._written[k] = self._epoch

    def _set(self, items: Iterable[tuple[str, V | None]], since: int | None) -> None:  # under the lock
        exp = time.monotonic() + self.ttl
        for k, v in items:
            if since is not None and self._written.get(k, -1) > since:
                continue  # a cached answer never replaces a newer write's
            self._d[k] = (exp, v)
            self._writes += 1
        if self._writes >= _PRUNE_EVERY:
            self._writes = 0
            now = time.monotonic()
            for k in [k for k, e in self._d.items() if e[0] <= now]:
                del self._d[k]

    def invalidate(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                self._d.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


__all__ = ["MetaCache"]
