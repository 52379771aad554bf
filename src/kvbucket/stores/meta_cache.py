"""A TTL cache of exact object metadata (present with size/hash, or known missing).

Remote lookups dominate the cost of a cache hit check; LMCache's connectors cache sizes for a
TTL too. Entries come only from the remote's own answers or from this process's acknowledged
writes and deletes, so a cached answer is at most ``ttl`` seconds older than the truth.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

V = TypeVar("V")

_MISSING = object()
_PRUNE_EVERY = 4096


class MetaCache(Generic[V]):
    """``key -> V | None`` (None = known missing) with one TTL; thread-safe; ttl <= 0 disables it."""

    def __init__(self, ttl_secs: float) -> None:
        self.ttl = float(ttl_secs)
        self._d: dict[str, tuple[float, V | None]] = {}
        self._lock = threading.Lock()
        self._writes = 0
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

    def set_many(self, items: Iterable[tuple[str, V | None]]) -> None:
        if self.ttl <= 0:
            return
        exp = time.monotonic() + self.ttl
        with self._lock:
            for k, v in items:
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
