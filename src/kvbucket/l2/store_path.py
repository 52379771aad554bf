"""The store path: ``submit_store_task`` writes a task's chunks and reports which landed.

Sizes: a task takes buffers of any sizes, mixed (as LMCache's adapters do), unless
``full_chunk_bytes`` is given, which refuses every other size. A store whose batch partly
failed asks the store (``head_many``) which objects landed and counts exactly those. Stored keys
are told to the listener before the completion is signalled (as LMCache's adapters do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbucket.errors import CircuitOpenError
from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2TaskId, StoreResult
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import log, nbytes, repeated
from kvbucket.l2.tasks import Completions
from kvbucket.stores.base import Buffer


class StorePath:
    """Store tasks and their completions (``done``: this path's results and event fd)."""

    def __init__(self, ctx: AdapterContext, after_store: Callable[[], None]) -> None:
        """``after_store``: called on the loop thread after each task (starts an eviction pass)."""
        self._ctx = ctx
        self._after_store = after_store
        self.done: Completions[StoreResult] = Completions()

    def submit(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        """``keepalive``: objects owning the buffers' memory, held until the task completes (a
        ctypes view of an LMCache MemoryObj does not keep the MemoryObj alive)."""
        keys, buffers = list(keys), list(buffers)
        st = self._ctx.state
        tid = self._ctx.runner.new_id()
        identity = self._ctx.names.naming.identity
        with st.lock:
            failed_now = st.closed or len(keys) != len(buffers)
            if not failed_now and identity.unknown():  # not known yet: never a guessed name
                failed_now = True
                identity.pending_refused += len(keys)
            if not failed_now:
                self._ctx.runner.schedule(self._run(tid, keys, buffers, keepalive))
        if failed_now:
            if len(keys) != len(buffers):
                log.error("store task %d: %d keys but %d buffers; refused", tid, len(keys), len(buffers))
            self.done.publish(tid, StoreResult.failed(len(keys)))
        return tid

    async def _run(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        st = self._ctx.state
        new_keys: list[ObjectKey] = []
        new_sizes: list[int] = []
        try:
            sizes = [nbytes(b) for b in buffers]
            # Any sizes, mixed in one task, as LMCache's adapters store them; only a configured
            # full_chunk_bytes refuses other sizes.
            fixed = st.full_fixed
            take = [i for i in range(n) if fixed is None or sizes[i] == fixed]
            if len(take) < n:
                self._ctx.stats["refused_unfull"] += n - len(take)
                log.warning(
                    "store task %d: refused %d chunk(s) whose size is not full_chunk_bytes=%d",
                    tid,
                    n - len(take),
                    fixed,
                )
            if self._ctx.fleet is not None and take:
                # The fleet's write cap: past it, a store fails like a full disk (docs/fleet.md).
                kept = self._ctx.fleet.admit([sizes[i] for i in take])
                if kept < len(take):
                    self._ctx.stats["refused_full"] += len(take) - kept
                    take = take[:kept]
            write_item, name_of = self._ctx.names.naming.write_item, self._ctx.names.name
            items = {i: write_item(keys[i], buffers[i], name_of(keys[i])) for i in take}
            names = {i: item[0] for i, item in items.items()}
            with st.lock:
                st.mark_storing(names.values())
            try:
                results = await self._ctx.runner.sliced(self._ctx.store.put_many, [items[i] for i in take])
            except BaseException:
                with st.lock:
                    st.unmark_storing(names.values())
                raise
            landed: dict[int, int] = {}
            versions: dict[int, str | None] = {}  # what eviction will name (docs/integrity.md)
            failed: list[int] = []
            for i, r in zip(take, results, strict=True):
                if r.ok:
                    landed[i] = r.size if r.size is not None else sizes[i]
                    versions[i] = r.version
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
                if not isinstance(first_error, CircuitOpenError):  # keep the cause the breaker opened on
                    self._ctx.stats.note_error("store", str(first_error))
                heads = await self._ctx.runner.sliced(self._ctx.store.head_many, [names[i] for i in failed])
                present: dict[int, int] = {}  # there, but not what we wrote (an older object)
                for i, h in zip(failed, heads, strict=True):
                    if h.found and h.size == sizes[i]:
                        landed[i] = h.size
                        versions[i] = h.version
                    elif h.found and h.size:
                        present[i] = h.size
                with st.lock:
                    for i, size in present.items():
                        if names[i] not in st.deleting:
                            st.index.add(names[i], keys[i], size, touch=False,
                                         version=heads[failed.index(i)].version)
            with st.lock:
                st.unmark_storing(names.values())
                for i, size in landed.items():
                    st.missing.pop(names[i], None)
                    if names[i] in st.deleting:
                        continue
                    was_new = names[i] not in st.index
                    st.index.add(names[i], keys[i], size, version=versions.get(i))
                    if was_new:
                        new_keys.append(keys[i])
                        new_sizes.append(size)
                if self._ctx.fleet is not None:
                    self._ctx.fleet.stored([names[i] for i in landed], landed.values())
            ok = len(landed) == n
            result = StoreResult(ok, sum(landed.values()), tuple(i in landed for i in range(n)))
        except Exception as e:
            log.exception("store task %d failed", tid)
            self._ctx.stats.note_error("store", f"{type(e).__name__}: {e}")
            result = StoreResult.failed(n)
        self._ctx.stats["stores"] += 1
        if not result.success:
            self._ctx.stats["store_failures"] += 1
        # LMCache's adapters tell the listener BEFORE signalling the completion, so a controller
        # woken by the signal finds its listener already told.
        self._ctx.listeners.stored(new_keys, new_sizes)
        self.done.publish(tid, result)
        self._after_store()
