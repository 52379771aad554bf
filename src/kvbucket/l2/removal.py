"""Deletes and eviction: both remove a key under every name it may have, skipping locked keys.

:class:`RemovalPath` owns ``evicting`` (one eviction pass at a time), set and cleared on the loop
thread; everything else it touches is the adapter's :class:`~kvbucket.l2.state.KeyState`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvbucket.errors import StoreError
from kvbucket.keys import ObjectKey
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import log
from kvbucket.l2.eviction import EvictionConfig, choose_victims
from kvbucket.stores.base import ItemResult
from kvbucket.stores.guard.refusals import delete_as_seen

# An eviction's delete that found the object written since (kept): not a failure.
_CHANGED = StoreError("written since it was judged: kept")


class RemovalPath:
    """``delete`` and the eviction passes a store starts."""

    def __init__(
        self,
        ctx: AdapterContext,
        *,
        eviction: EvictionConfig | None,
        capacity: int,
        delete_timeout: float,
    ) -> None:
        self._ctx = ctx
        self._eviction = eviction
        self._capacity = capacity
        self._delete_timeout = delete_timeout
        self.evicting = False

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Remove each key under every name it may have. As LMCache's hfbucket and s3 adapters
        do, every removed key is reported to the listener, a key that was not stored included
        (with size 0); locked keys are skipped and not reported."""
        keys = list(keys)
        st = self._ctx.state
        cands = [self._ctx.names.names(k) for k in keys]
        with st.lock:
            if st.closed:
                return [False] * len(keys)
            take = [
                i
                for i, c in enumerate(cands)
                if not any(st.key_locks.get(nm) or nm in st.deleting for nm in c)
            ]
            for i in take:
                st.deleting.update(cands[i])
        flat = [nm for i in take for nm in cands[i]]
        gone, sizes = self._ctx.runner.run(self._delete_names(flat, notify=False), self._delete_timeout)
        removed = dict(zip(flat, gone, strict=True))
        out = [False] * len(keys)
        for i in take:
            out[i] = all(removed[nm] for nm in cands[i])
        told = [i for i in take if out[i]]
        self._ctx.listeners.deleted(
            [keys[i] for i in told], [sum(sizes.get(nm, 0) for nm in cands[i]) for i in told]
        )
        self._ctx.stats["deleted_keys"] += sum(out)
        return out

    async def _delete_names(
        self, names: list[str], *, notify: bool = True, evicted: bool = False,
        versions: dict[str, str | None] | None = None,
    ) -> tuple[list[bool], dict[str, int]]:
        """Delete from the store, then from the index; names must be in the state's ``deleting``.

        With ``versions`` (eviction: as the index saw them), a name is removed only while it holds
        that version (docs/integrity.md): one written since stays, and stays indexed as unknown.
        Returns which names are gone and the indexed size of each removed indexed name; with
        ``notify`` the listener is told of the removed indexed keys."""
        st = self._ctx.state
        try:
            results = await self._delete(names, versions or {}, evicted)
        except Exception as e:
            results = [ItemResult(n, error=StoreError(str(e))) for n in names]
        removed = [r.ok for r in results]
        if results and all(r.ok or r.error is _CHANGED for r in results):
            self._ctx.stats.note_ok("delete")
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        sizes: dict[str, int] = {}
        with st.lock:
            for name, r in zip(names, results, strict=True):
                st.deleting.discard(name)
                if r.error is _CHANGED:  # written since: another version, kept, and recent
                    if (entry := st.index.get(name)) is not None:
                        entry.version = None  # a later eviction judges it anew (a HEAD's version)
                        st.index.touch(name)
                        if self._ctx.fleet is not None:  # the fleet's view of it is stale too
                            self._ctx.fleet.stored([name], [entry.size])
                    continue
                if not r.ok:
                    self._ctx.stats["delete_failures"] += 1
                    self._ctx.stats.note_error("delete", str(r.error))
                    continue
                if self._ctx.fleet is not None:
                    self._ctx.fleet.deleted([name], evicted=evicted)
                entry = st.index.get(name)
                size = st.forget(name)
                if entry is not None:
                    sizes[name] = size
                    gone_keys.append(entry.key)
                    gone_sizes.append(size)
        if notify:
            self._ctx.listeners.deleted(gone_keys, gone_sizes)
        return removed, sizes

    async def _delete(self, names: list[str], versions: dict[str, str | None], evicted: bool
                      ) -> list[ItemResult]:
        """An eviction's names: removed only while they hold the version the index saw (or, when
        it saw none, a HEAD sees now): ``_CHANGED`` when written since. A user's delete: as they are."""
        if not evicted:
            return await self._ctx.runner.sliced(self._ctx.store.delete_many, names)
        path = "fleet_eviction" if self._ctx.fleet is not None else "eviction"
        done = await self._ctx.runner.loop.run_in_executor(
            self._ctx.runner.pool, delete_as_seen, self._ctx.store, names, versions, path)
        out = []
        for n in names:
            r = done.get(n)
            if r is None:
                out.append(ItemResult(n, error=StoreError("no answer for this delete")))
            elif getattr(r, "changed", False):
                out.append(ItemResult(n, error=_CHANGED))
            else:
                out.append(ItemResult(n, error=r.error))
        return out

    def maybe_evict(self) -> None:
        """Called on the loop thread after a store or a fleet round: start one eviction pass if needed."""
        cfg = self._eviction
        st = self._ctx.state
        if cfg is None or self.evicting or st.closed:
            return
        with st.lock:
            expired = self._ctx.fleet is not None and self._ctx.fleet.has_expired()
            if not expired and not cfg.triggered(st.index.bytes_used, self._capacity):
                return
            self.evicting = True
        # In the runner's in-flight set (not a bare loop task): close() waits for the pass within
        # its deadline, and the runner cancels it if it is still waiting on a delete then.
        self._ctx.runner.schedule(self._evict())

    def evict_on_close(self, deadline: float) -> None:
        """close(), after the queued stores landed: they may have passed the watermark, and no
        pass follows a store once the adapter is closed, so one last pass runs here, within what
        is left of close's ``deadline``. Past it the pass is cancelled and the bucket stays over
        its capacity until an adapter on this prefix evicts (after its usage rebuild or a store)."""
        cfg = self._eviction
        st = self._ctx.state
        if cfg is None:
            return
        with st.lock:
            expired = self._ctx.fleet is not None and self._ctx.fleet.has_expired()
            if not expired and not cfg.triggered(st.index.bytes_used, self._capacity):
                return
            running, self.evicting = self.evicting, True
        left = deadline - time.monotonic()
        try:
            if running or left <= 0:  # a pass close waited for until its deadline is still running
                raise TimeoutError
            self._ctx.runner.run(self._evict(closing=True), left)
        except Exception:  # TimeoutError (the pass is cancelled when the loop stops), or it failed
            with st.lock:
                used, objects = st.index.bytes_used, len(st.index)
                writing = len(st.storing)
            # What this adapter knows landed; stores still in flight at the deadline may land
            # after it (and each object carries a small header): "at least", not a bucket total.
            log.warning(
                "close(): eviction did not finish within the close deadline; at least %d bytes in %d "
                "objects are stored against a capacity of %d%s, until an adapter on this prefix evicts "
                "(after its usage rebuild or its first store)", used, objects, self._capacity,
                f" ({writing} more stores were still in flight and may land)" if writing else "",
            )

    async def _evict(self, *, closing: bool = False) -> None:
        """Delete victims until usage is under the target; ``closing``: close's last pass, which
        runs although the adapter is closed (every other pass stops when it closes)."""
        assert self._eviction is not None
        st = self._ctx.state
        try:
            while closing or not st.closed:
                with st.lock:
                    busy = set(st.key_locks) | st.deleting
                    if self._ctx.fleet is not None:
                        victims = self._ctx.fleet.victims(busy)
                    else:
                        victims = choose_victims(st.index, self._capacity, self._eviction, busy)
                    sizes = {v: e.size for v in victims if (e := st.index.get(v)) is not None}
                    versions = {v: e.version if e is not None else None
                                for v in victims for e in (st.index.get(v),)}
                    st.deleting.update(victims)
                if not victims:
                    return
                removed, _ = await self._delete_names(victims, evicted=True, versions=versions)
                self._ctx.stats["evicted_keys"] += sum(removed)
                self._ctx.stats["evicted_bytes"] += sum(
                    sizes.get(v, 0) for v, r in zip(victims, removed, strict=True) if r
                )
                if not any(removed) or self._ctx.fleet is not None:
                    # The store refuses deletes (try again after the next store), or a fleet
                    # node took its share of this round (the next sync round shows the rest).
                    return
        finally:
            self.evicting = False
