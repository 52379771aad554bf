"""Deletes and eviction: both remove a key under every name it may have, skipping locked keys."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from kvbucket.errors import StoreError
from kvbucket.keys import ObjectKey
from kvbucket.l2.core import AdapterCore
from kvbucket.l2.eviction import choose_victims
from kvbucket.stores.base import ItemResult


class RemovalPath(AdapterCore):
    """``delete`` and the eviction passes a store starts."""

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Remove each key under every name it may have. As LMCache's hfbucket and s3 adapters
        do, every removed key is reported to the listener, a key that was not stored included
        (with size 0); locked keys are skipped and not reported."""
        keys = list(keys)
        cands = [self._names(k) for k in keys]
        with self._lock:
            if self._closed:
                return [False] * len(keys)
            take = [
                i
                for i, c in enumerate(cands)
                if not any(self._locks.get(nm) or nm in self._deleting for nm in c)
            ]
            for i in take:
                self._deleting.update(cands[i])
        if threading.current_thread() is self._thread:
            raise RuntimeError("delete() must not be called from the adapter's own loop thread")
        flat = [nm for i in take for nm in cands[i]]
        fut = asyncio.run_coroutine_threadsafe(self._delete_names(flat, notify=False), self._loop)
        gone, sizes = fut.result(timeout=self._delete_timeout)
        removed = dict(zip(flat, gone, strict=True))
        out = [False] * len(keys)
        for i in take:
            out[i] = all(removed[nm] for nm in cands[i])
        told = [i for i in take if out[i]]
        if told and self.listener is not None:
            self._tell(
                self.listener.on_keys_deleted,
                [keys[i] for i in told],
                [sum(sizes.get(nm, 0) for nm in cands[i]) for i in told],
            )
        self._stats["deleted_keys"] += sum(out)
        return out

    async def _delete_names(
        self, names: list[str], *, notify: bool = True, evicted: bool = False
    ) -> tuple[list[bool], dict[str, int]]:
        """Delete from the store, then from the index; names must be in ``_deleting``.

        Returns which names are gone and the indexed size of each removed indexed name; with
        ``notify`` the listener is told of the removed indexed keys."""
        try:
            results = await self._sliced(self._store.delete_many, names)
        except Exception as e:
            results = [ItemResult(n, error=StoreError(str(e))) for n in names]
        removed = [r.ok for r in results]
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        sizes: dict[str, int] = {}
        with self._lock:
            for name, r in zip(names, results, strict=True):
                self._deleting.discard(name)
                if not r.ok:
                    self._stats["delete_failures"] += 1
                    self._last_error = str(r.error)
                    continue
                if not self._rebuilt:
                    self._deleted_while_rebuilding.add(name)
                if self._fleet is not None:
                    self._fleet.deleted([name], evicted=evicted)
                entry = self._index.get(name)
                size = self._index.remove(name)
                if entry is not None:
                    sizes[name] = size
                    gone_keys.append(entry.key)
                    gone_sizes.append(size)
        if notify and gone_keys and self.listener is not None:
            self._tell(self.listener.on_keys_deleted, gone_keys, gone_sizes)
        return removed, sizes

    def _maybe_evict(self) -> None:
        """Called on the loop thread after a store: start one eviction pass if needed."""
        cfg = self._eviction
        if cfg is None or self._evicting or self._closed:
            return
        with self._lock:
            expired = self._fleet is not None and self._fleet.has_expired()
            if not expired and not cfg.triggered(self._index.bytes_used, self._capacity):
                return
            self._evicting = True
        self._loop.create_task(self._evict())

    async def _evict(self) -> None:
        assert self._eviction is not None
        try:
            while not self._closed:
                with self._lock:
                    busy = set(self._locks) | self._deleting
                    if self._fleet is not None:
                        victims = self._fleet.victims(busy)
                    else:
                        victims = choose_victims(self._index, self._capacity, self._eviction, busy)
                    sizes = {v: e.size for v in victims if (e := self._index.get(v)) is not None}
                    self._deleting.update(victims)
                if not victims:
                    return
                removed, _ = await self._delete_names(victims, evicted=True)
                self._stats["evicted_keys"] += sum(removed)
                self._stats["evicted_bytes"] += sum(
                    sizes.get(v, 0) for v, r in zip(victims, removed, strict=True) if r
                )
                if not any(removed) or self._fleet is not None:
                    # The store refuses deletes (try again after the next store), or a fleet
                    # node took its share of this round (the next sync round shows the rest).
                    return
        finally:
            self._evicting = False
