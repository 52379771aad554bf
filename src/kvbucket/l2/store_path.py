"""The store path: ``submit_store_task`` writes a task's chunks and reports which landed.

Sizes: a task takes buffers of any sizes, mixed (as LMCache's adapters do), unless
``full_chunk_bytes`` is given, which refuses every other size. A store whose batch partly
failed asks the store (``head_many``) which objects landed and counts exactly those. Stored keys
are told to the listener before the completion is signalled (as LMCache's adapters do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2TaskId, StoreResult
from kvbucket.l2.core import AdapterCore, log, nbytes, repeated
from kvbucket.stores.base import Buffer


class StorePath(AdapterCore):
    """Store tasks and their completions."""

    def submit_store_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        """``keepalive``: objects owning the buffers' memory, held until the task completes (a
        ctypes view of an LMCache MemoryObj does not keep the MemoryObj alive)."""
        keys, buffers = list(keys), list(buffers)
        with self._lock:
            tid = self._new_id()
            if self._closed or len(keys) != len(buffers):
                if len(keys) != len(buffers):
                    log.error("store task %d: %d keys but %d buffers; refused", tid, len(keys), len(buffers))
                self._store_done[tid] = StoreResult.failed(len(keys))
                failed_now = True
            else:
                failed_now = False
                self._schedule(self._run_store(tid, keys, buffers, keepalive))
        if failed_now:
            self._store_efd.notify()
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, StoreResult]:
        with self._lock:
            done, self._store_done = self._store_done, {}
        return done

    async def _run_store(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        new_keys: list[ObjectKey] = []
        new_sizes: list[int] = []
        try:
            sizes = [nbytes(b) for b in buffers]
            # Any sizes, mixed in one task, as LMCache's adapters store them; only a configured
            # full_chunk_bytes refuses other sizes.
            fixed = self._full_fixed
            take = [i for i in range(n) if fixed is None or sizes[i] == fixed]
            if len(take) < n:
                self._stats["refused_unfull"] += n - len(take)
                log.warning(
                    "store task %d: refused %d chunk(s) whose size is not full_chunk_bytes=%d",
                    tid,
                    n - len(take),
                    fixed,
                )
            if self._fleet is not None and take:
                # The fleet's write cap: past it, a store fails like a full disk (docs/fleet.md).
                kept = self._fleet.admit([sizes[i] for i in take])
                if kept < len(take):
                    self._stats["refused_full"] += len(take) - kept
                    take = take[:kept]
            items = {i: self._naming.write_item(keys[i], buffers[i], self._name(keys[i])) for i in take}
            names = {i: item[0] for i, item in items.items()}
            with self._lock:
                for nm in names.values():
                    self._storing[nm] = self._storing.get(nm, 0) + 1
            try:
                results = await self._sliced(self._store.put_many, [items[i] for i in take])
            except BaseException:
                self._unmark_storing(names.values())
                raise
            landed: dict[int, int] = {}
            failed: list[int] = []
            for i, r in zip(take, results, strict=True):
                if r.ok:
                    landed[i] = r.size if r.size is not None else sizes[i]
                else:
                    failed.append(i)
            if failed:
                # Remote batches are not transactional: ask which objects are there now.
                first_error = results[take.index(failed[0])].error
                repeated.warning(
                    "store task %d: %d of %d puts failed (%s); checking what landed",
                    tid,
                    len(failed),
                    len(take),
                    first_error,
                    same=f"store puts failed: {first_error}",
                )
                heads = await self._sliced(self._store.head_many, [names[i] for i in failed])
                present: dict[int, int] = {}  # there, but not what we wrote (an older object)
                for i, h in zip(failed, heads, strict=True):
                    if h.found and h.size == sizes[i]:
                        landed[i] = h.size
                    elif h.found and h.size:
                        present[i] = h.size
                with self._lock:
                    for i, size in present.items():
                        if names[i] not in self._deleting:
                            self._index.add(names[i], keys[i], size, touch=False)
            with self._lock:
                self._unmark_storing_locked(names.values())
                for i, size in landed.items():
                    self._missing.pop(names[i], None)
                    if names[i] in self._deleting:
                        continue
                    was_new = names[i] not in self._index
                    self._index.add(names[i], keys[i], size)
                    if was_new:
                        new_keys.append(keys[i])
                        new_sizes.append(size)
                if self._fleet is not None:
                    self._fleet.stored([names[i] for i in landed], landed.values())
            ok = len(landed) == n
            result = StoreResult(ok, sum(landed.values()), tuple(i in landed for i in range(n)))
        except Exception as e:
            log.exception("store task %d failed", tid)
            self._last_error = f"{type(e).__name__}: {e}"
            result = StoreResult.failed(n)
        self._stats["stores"] += 1
        if not result.success:
            self._stats["store_failures"] += 1
        # LMCache's adapters tell the listener BEFORE signalling the completion, so a controller
        # woken by the signal finds its listener already told.
        if new_keys and self.listener is not None:
            self._tell(self.listener.on_keys_stored, new_keys, new_sizes)
        with self._lock:
            self._store_done[tid] = result
        self._store_efd.notify()
        self._maybe_evict()

    def _unmark_storing(self, names: Any) -> None:
        with self._lock:
            self._unmark_storing_locked(names)

    def _unmark_storing_locked(self, names: Any) -> None:
        for nm in names:
            c = self._storing.get(nm, 0)
            if c <= 1:
                self._storing.pop(nm, None)
            else:
                self._storing[nm] = c - 1
