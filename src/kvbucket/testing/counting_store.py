"""An ObjectStore wrapper that counts calls: how tests and benchmarks measure request counts.

Each batch verb call counts as one call; a listing counts one call per page of ``page_size``
names (at least one), which is what list-by-page backends (S3, the Hub) send.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence

from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore


class CountingStore(ObjectStore):
    """Forwards every verb to ``inner`` and counts calls (``calls``) and items (``items``)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: Counter[str] = Counter()
        self.items: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, verb: str, n: int, calls: int = 1) -> None:
        with self._lock:
            self.calls[verb] += calls
            self.items[verb] += n

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.items.clear()

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        self._count("put", len(items))
        return self.inner.put_many(items)

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        self._count("get", len(names))
        return self.inner.get_many(names, out)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._count("head", len(names))
        return self.inner.head_many(names)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._count("delete", len(names))
        return self.inner.delete_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        n = 0
        for info in self.inner.list(prefix, page_size=page_size):
            if n % page_size == 0:
                self._count("list", 0)
            n += 1
            self._count("list", 1, calls=0)
            yield info
        if n == 0:
            self._count("list", 0)

    def close(self) -> None:
        self.inner.close()


__all__ = ["CountingStore"]
