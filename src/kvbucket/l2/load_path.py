"""The load path: fill callers' buffers from the store.

A load fills a buffer only from an object of exactly the buffer's size (another size is a miss
and the buffer is untouched). It tries the name the index knows first, then the key's other
names; a load that finds an object gone removes it from the index and tells the listener (self-
healing when another server deleted it). An object the load refused but that is still there
(intact, not for this reader: docs/integrity.md, "What a reader may delete") is remembered as a
lookup miss for ``refused_ttl`` seconds, so lookups do not answer hits this reader cannot load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvbucket.errors import SizeMismatchError
from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2TaskId
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import log, repeated
from kvbucket.l2.tasks import Completions
from kvbucket.stores.base import Buffer


class LoadPath:
    """Load tasks and their completions (``done``: this path's results and event fd)."""

    def __init__(self, ctx: AdapterContext, *, refused_ttl: float = 0.0) -> None:
        self._ctx = ctx
        self._refused_ttl = refused_ttl
        self.done: Completions[list[bool]] = Completions()

    def submit(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        keys, buffers = list(keys), list(buffers)
        tid = self._ctx.runner.new_id()
        with self._ctx.state.lock:
            if self._ctx.names.naming.identity.unknown(len(keys)):  # not known yet: misses (counted)
                pass
            elif not self._ctx.state.closed and len(keys) == len(buffers):
                self._ctx.runner.schedule(self._run(tid, keys, buffers, keepalive))
                return tid
        self.done.publish(tid, [False] * len(keys))
        return tid

    async def _run(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        st = self._ctx.state
        ok = [False] * n
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        gone_names: list[str] = []
        try:
            cands = [self._ctx.names.names(k) for k in keys]
            with st.lock:
                # The name the index knows first, then the others in order.
                order = [_known_first(c, st.where(c)) for c in cands]
                if st.not_loaded:  # LMCache loads these from here now: read them ahead again
                    for c in cands:
                        for nm in c:
                            st.not_loaded.pop(nm, None)
            todo = list(range(n))
            r = 0
            while todo:
                results = await self._ctx.runner.sliced(
                    self._ctx.store.get_many, [order[i][r] for i in todo], [buffers[i] for i in todo]
                )
                retry: list[int] = []
                with st.lock:
                    for i, res in zip(todo, results, strict=True):
                        name = order[i][r]
                        if res.found:
                            ok[i] = True
                            st.index.touch(name)
                        elif isinstance(res.error, SizeMismatchError):
                            self._ctx.stats["size_mismatches"] += 1
                            repeated.warning("load task %d: %s; reported as a miss", tid, res.error, item=tid)
                        elif res.ok:  # not there (deleted elsewhere), or refused and kept (another
                            # tenant, name or key): forget it, try the next name
                            size = st.forget(name)
                            if size:
                                gone_keys.append(keys[i])
                                gone_sizes.append(size)
                                gone_names.append(name)
                            if r + 1 < len(order[i]):
                                retry.append(i)
                        else:
                            self._ctx.stats.note_error("load", str(res.error))
                todo, r = retry, r + 1
            if gone_names:
                # A miss tells the fleet of a deletion only when the object is gone: one this
                # reader refused and kept (another root or name, no keyring, another key;
                # docs/integrity.md, "What a reader may delete") is still there, and still
                # counted, for the nodes that read it; here it is a remembered lookup miss.
                heads = await self._ctx.runner.sliced(self._ctx.store.head_many, gone_names)
                kept = [h.name for h in heads if h.found]
                if kept and self._refused_ttl > 0:
                    expiry = time.monotonic() + self._refused_ttl
                    with st.lock:
                        st.missing.update(dict.fromkeys(kept, expiry))
                if self._ctx.fleet is not None:
                    self._ctx.fleet.deleted([h.name for h in heads if h.ok and h.size is None])
        except Exception as e:
            log.exception("load task %d failed", tid)
            self._ctx.stats.note_error("load", f"{type(e).__name__}: {e}")
        self._ctx.stats["loads"] += 1
        self._ctx.stats["load_misses"] += ok.count(False)
        self._ctx.listeners.deleted(gone_keys, gone_sizes)
        self.done.publish(tid, ok)


def _known_first(cands: tuple[str, ...], known: str | None) -> tuple[str, ...]:
    if known is None or known == cands[0]:
        return cands
    return (known, *(c for c in cands if c != known))
