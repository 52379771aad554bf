"""The lookup-and-lock path: which keys the store holds, locking the hits until ``submit_unlock``.

Lookups answer from the index when they can, so a hit costs no request and no hop through the
loop thread; unknown keys are asked with one ``head_many`` over every name format (kvbucket's and
LMCache's) and a miss is remembered for ``metadata_cache_ttl_secs`` (objects written by another
server show up after that long at most). While the store's circuit breaker is open, keys the
index does not know are misses at once, in the caller's thread (no request, no hop). A hit needs
the full size, known from ``full_chunk_bytes`` or from the layout passed with a lookup (LMCache's
``MemoryLayoutDesc``, per object group), or, with neither, a non-empty object. Accessed keys are
told to the listener right after the lookup's signal, as LMCache's hfbucket and s3 adapters do.
Hits start their loads before the signal (read-ahead, :mod:`kvbucket.stores.guard.read_ahead`), so
LMCache's ``load`` that follows finds the bytes landed or on their way.

LMCache 0.5.6's MP prefetch controller looks every key up in every L2 adapter, L1 hits included,
then loads each key from one tier only (L1 first, then the lowest-indexed adapter holding it) and
unlocks the rest (``storage_controllers/prefetch_controller.py``: ``_start_lookup_phase``,
``_plan_load``; ``prefetch_policy.DefaultPrefetchPolicy``). A key unlocked with its read-ahead
untaken was not loaded from here: its buffer is freed at once and its later lookups start no
read-ahead (``KeyState.not_loaded``) until a load of it comes, so a prefix held in LMCache's L1,
or by an adapter listed before this one, is not fetched again on every request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvbucket.errors import CircuitOpenError, InvalidKeyError
from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2TaskId
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import log
from kvbucket.l2.tasks import Completions
from kvbucket.stores.guard.breaker import CircuitBreaker
from kvbucket.stores.guard.read_ahead import drop_unused, read_ahead

#: Names remembered as not loaded from this adapter (:attr:`KeyState.not_loaded`), oldest dropped.
NOT_LOADED_LIMIT = 65536


class LookupPath:
    """Lookup-and-lock tasks, their completions (``done``: results and event fd), and unlocks."""

    def __init__(
        self,
        ctx: AdapterContext,
        *,
        breaker: CircuitBreaker | None,
        negative_ttl: float,
    ) -> None:
        self._ctx = ctx
        self._breaker = breaker  # while open, lookups answer from the index alone, at once
        self._neg_ttl = negative_ttl
        self.done: Completions[list[bool]] = Completions()

    def submit(self, keys: Sequence[ObjectKey], layout: Any | None = None) -> L2TaskId:
        keys = list(keys)
        st = self._ctx.state
        if self._ctx.names.naming.identity.unknown(len(keys)):  # not known yet: misses (counted)
            tid = self._ctx.runner.new_id()
            self.done.publish(tid, [False] * len(keys))
            return tid
        try:
            cands: list[tuple[str, ...]] | None = [self._ctx.names.names(k) for k in keys]
        except InvalidKeyError:
            cands = None  # the task reports it (as misses) from the loop
        accessed: list[ObjectKey] = []
        ahead: list[tuple[str, int]] = []  # (name, size) of hits: their loads start now
        tid = self._ctx.runner.new_id()
        with st.lock:
            if st.full_fixed is None:
                if isinstance(layout, int) and layout > 0:
                    layout = {0: layout}
                if isinstance(layout, dict):
                    st.full.update({int(g): int(b) for g, b in layout.items() if int(b) > 0})
            done: list[bool] | None = None
            if st.closed:
                done = [False] * len(keys)
            elif cands is not None:
                # Every key answered by the index (or a fresh remembered miss): no I/O is needed,
                # so answer now instead of paying a hop through the loop thread.
                done = self._from_index(keys, cands, accessed, unknown_misses=False, ahead=ahead)
                if done is None and self._breaker is not None and self._breaker.refusing():
                    # The store's breaker is open: what the index does not know is a miss now, with
                    # no request and no hop through the loop thread (the engine recomputes).
                    done = self._lock_hits(keys, cands, accessed, ahead)
                    unasked = len(keys) - sum(done)
                    self._ctx.stats["breaker_misses"] += unasked
                    self._breaker.count_rejected("head", unasked)
            if done is None:
                self._ctx.runner.schedule(self._run(tid, keys))
        if done is not None:
            self._ctx.stats["lookups"] += 1
            self._finish(tid, done, accessed, ahead)
        return tid

    def _finish(self, tid: L2TaskId, hits: list[bool], accessed: list[ObjectKey],
                ahead: list[tuple[str, int]]) -> None:
        """Start the hits' loads (read-ahead, before the signal: a load that follows at once finds
        them on their way), publish and signal the result, then tell the listener of the hits:
        LMCache's hfbucket and s3 adapters call ``_notify_keys_accessed`` right after the lookup
        signal, which keeps LMCache's listeners and event bus off the lookup's latency."""
        st = self._ctx.state
        if ahead and st.not_loaded:
            with st.lock:
                kept = [(n, z) for n, z in ahead if n not in st.not_loaded]
            self._ctx.stats["read_ahead_skipped"] += len(ahead) - len(kept)
            ahead = kept
        if ahead:
            read_ahead(self._ctx.store, [n for n, _ in ahead], [z for _, z in ahead])
        self.done.publish(tid, hits)
        self._ctx.listeners.accessed(accessed)

    def _from_index(
        self,
        keys: list[ObjectKey],
        cands: list[tuple[str, ...]],
        accessed: list[ObjectKey],
        *,
        unknown_misses: bool,
        ahead: list[tuple[str, int]] | None = None,
    ) -> list[bool] | None:
        """The answer from the index, hits locked and touched (call with the state's lock).

        A key is looked for under its names in order. One that is under none of them is a miss
        when ``unknown_misses`` (or a fleet tells every store through its journals) or when each
        name is a fresh remembered miss; otherwise the store must be asked: None, nothing changed.
        Plain loops: this runs per key on every lookup."""
        st = self._ctx.state
        get = st.index.get
        unknown_misses = unknown_misses or (self._ctx.fleet is not None and st.rebuilt)
        now = 0.0
        found: list[tuple[int, str, int]] = []
        for i, c in enumerate(cands):
            for name in c:
                entry = get(name)
                if entry is not None:
                    found.append((i, name, entry.size))
                    break
            else:
                if not unknown_misses:
                    now = now or time.monotonic()
                    for name in c:
                        if st.missing.get(name, 0.0) <= now:
                            return None
        hits = [False] * len(keys)
        hit_names: list[str] = []
        fixed, full, deleting, locks = st.full_fixed, st.full, st.deleting, st.key_locks
        touch = st.index.touch
        for i, name, size in found:
            want = fixed if fixed is not None else full.get(keys[i].kv_rank >> 32)
            if size <= 0 or (want is not None and size != want) or name in deleting:
                continue
            hits[i] = True
            locks[name] = locks.get(name, 0) + 1
            touch(name)
            accessed.append(keys[i])
            hit_names.append(name)
            if ahead is not None:
                ahead.append((name, size))
        if self._ctx.fleet is not None and hit_names:
            self._ctx.fleet.accessed(hit_names)
        return hits

    def _lock_hits(
        self, keys: list[ObjectKey], cands: list[tuple[str, ...]], accessed: list[ObjectKey],
        ahead: list[tuple[str, int]] | None = None,
    ) -> list[bool]:
        """Hits among indexed names, locked and touched; every other key a miss (call with the lock)."""
        hits = self._from_index(keys, cands, accessed, unknown_misses=True, ahead=ahead)
        assert hits is not None
        return hits

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one lock per key; a name no lookup holds any more whose read-ahead no load took
        was not loaded from here (module docstring): freed, and remembered as not loaded."""
        st = self._ctx.state
        released: list[str] = []
        if self._ctx.names.naming.identity.unknown():  # no lookup could lock a key: nothing to drop
            return
        with st.lock:
            locks = st.key_locks
            for key in keys:
                try:
                    cands = self._ctx.names.names(key)
                except InvalidKeyError:
                    continue
                name = next((n for n in cands if locks.get(n)), None)
                if name is None:
                    continue
                count = locks[name]
                if count <= 1:
                    locks.pop(name, None)
                    released.append(name)
                else:
                    locks[name] = count - 1
        unused = drop_unused(self._ctx.store, released)
        if unused or st.not_loaded:
            with st.lock:
                marks = st.not_loaded
                for name in unused:
                    marks[name] = None
                for name in released:  # still not loaded (a load clears the mark): keep it longest
                    if name in marks:
                        marks.move_to_end(name)
                while len(marks) > NOT_LOADED_LIMIT:
                    marks.popitem(last=False)

    async def _run(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        st = self._ctx.state
        n = len(keys)
        hits = [False] * n
        accessed: list[ObjectKey] = []
        ahead: list[tuple[str, int]] = []
        try:
            cands = [self._ctx.names.names(k) for k in keys]
            found: list[ObjectKey] = []
            found_sizes: list[int] = []
            # Every name format in one round (one head_many): a key not found under kvbucket's
            # name is found under LMCache's, so a bucket LMCache filled is read without any
            # setting, at the latency of one round.
            now = time.monotonic()
            ask: list[tuple[int, str]] = []
            with st.lock:
                for i, c in enumerate(cands):
                    if st.where(c) is not None:
                        continue
                    ask.extend((i, nm) for nm in c if st.missing.get(nm, 0.0) <= now)
            if ask:
                heads = await self._ctx.runner.sliced(self._ctx.store.head_many, [nm for _, nm in ask])
                expiry = time.monotonic() + self._neg_ttl
                with st.lock:
                    for (i, name), h in zip(ask, heads, strict=True):
                        if h.found and h.size:
                            if name not in st.index and name not in st.deleting:
                                st.index.add(name, keys[i], h.size, version=h.version)
                                found.append(keys[i])
                                found_sizes.append(h.size)
                        elif h.ok and self._neg_ttl > 0:
                            st.missing[name] = expiry
                failed = next((h.error for h in heads if h.error is not None), None)
                if failed is not None and not isinstance(failed, CircuitOpenError):
                    self._ctx.stats.note_error("lookup", str(failed))  # a miss now, not the answer
            self._ctx.listeners.stored(found, found_sizes)
            with st.lock:
                hits = self._lock_hits(keys, cands, accessed, ahead)
        except Exception as e:
            log.exception("lookup task %d failed", tid)
            self._ctx.stats.note_error("lookup", f"{type(e).__name__}: {e}")
        self._ctx.stats["lookups"] += 1
        self._finish(tid, hits, accessed, ahead)
