"""The storage-backend interface (seed 002): chunk tiers keyed by :class:`CacheEngineKey`.

A *chunk* is the KV cache of one run of tokens, as one contiguous bytes-like buffer (bytes,
memoryview, numpy array, or a CPU torch tensor when torch is installed). Backends return
chunks as read-only bytes-like objects (``bytes`` or ``memoryview``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

from kvbucket.keys import CacheEngineKey

log = logging.getLogger(__name__)

Chunk: TypeAlias = Any  # a bytes-like buffer; see kvbucket.chunks.as_view
Key: TypeAlias = CacheEngineKey | str


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
                log.warning("%s: put of %s failed: %s", type(self).__name__, key, err)
        return sum(1 for r in results if r is None)

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        """Per-item outcome of a batch put, in input order: None when stored (or accepted)."""
        out: list[Exception | None] = []
        for key, chunk in items:
            try:
                self.put(key, chunk, blocking=blocking)
            except Exception as e:
                out.append(e)
                continue
            out.append(None)
        return out

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        return [self.get(k) for k in keys]

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait until every non-blocking put issued so far has landed (or failed and been logged)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush pending work and release resources. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Chunk", "Key", "StorageBackend"]
