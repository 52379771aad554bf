"""An in-process object store: the reference implementation of the protocol, for unit tests.

A version is a counter bumped by every put (``m<n>``): :meth:`MemoryStore.delete_versions`
compares it under the store's lock, so it has no window at all."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence

from kvbucket.errors import StoreError
from kvbucket.stores.base import (
    Buffer,
    ItemResult,
    ObjectInfo,
    ObjectStore,
    VersionedDelete,
    check_buffer_size,
)


class MemoryStore(ObjectStore):
    """Objects in a dict guarded by a lock. ``memory://`` URLs select it."""

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._versions: dict[str, str] = {}
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        names = self._names([n for n, _ in items])
        copies = [bytes(memoryview(d).cast("B")) for _, d in items]
        versions = []
        with self._lock:
            for n, b in zip(names, copies, strict=True):
                self._objects[n] = b
                self._versions[n] = v = f"m{next(self._counter)}"
                versions.append(v)
        return [ItemResult(n, size=len(b), version=v)
                for n, b, v in zip(names, copies, versions, strict=True)]

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        names = self._names(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        with self._lock:
            found = [self._objects.get(n) for n in names]
        results = []
        for i, (n, b) in enumerate(zip(names, found, strict=True)):
            buf = out[i] if out is not None else None
            if b is None:
                results.append(ItemResult(n))
            elif buf is None:
                results.append(ItemResult(n, size=len(b), data=b))
            else:
                try:
                    view = check_buffer_size(n, len(b), buf)
                except StoreError as e:
                    results.append(ItemResult(n, error=e))
                    continue
                view[:] = b
                results.append(ItemResult(n, size=len(b), data=buf))
        return results

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._names(names)
        with self._lock:
            found = [(len(self._objects[n]), self._versions[n]) if n in self._objects else (None, None)
                     for n in names]
        return [ItemResult(n, size=s, version=v) for n, (s, v) in zip(names, found, strict=True)]

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._names(names)
        with self._lock:
            gone = [self._objects.pop(n, None) for n in names]
            for n in names:
                self._versions.pop(n, None)
        return [ItemResult(n, size=None if g is None else len(g)) for n, g in zip(names, gone, strict=True)]

    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._names(names)
        with self._lock:
            found = [(self._objects.get(n), self._versions.get(n)) for n in names]
        return [ItemResult(n) if b is None else ItemResult(n, size=len(b), data=b, version=v)
                for n, (b, v) in zip(names, found, strict=True)]

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        names = self._names([n for n, _ in items])
        out = []
        with self._lock:
            for n, (_, version) in zip(names, items, strict=True):
                now = self._versions.get(n)
                if now is None:
                    out.append(VersionedDelete(n))
                elif now != version:
                    out.append(VersionedDelete(n, changed=True))
                else:
                    del self._objects[n], self._versions[n]
                    out.append(VersionedDelete(n, removed=True))
        return out

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        with self._lock:
            snapshot = sorted((n, len(b), self._versions[n]) for n, b in self._objects.items()
                              if n.startswith(prefix))
        for n, s, v in snapshot:
            yield ObjectInfo(n, s, version=v)
