"""The load path: fill callers' buffers from the store.

A load fills a buffer only from an object of exactly the buffer's size (another size is a miss
and the buffer is untouched). It tries the name the index knows first, then the key's other
names; a load that finds an object gone removes it from the index and tells the listener (self-
healing when another server deleted it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbucket.errors import SizeMismatchError
from kvbucket.keys import ObjectKey
from kvbucket.l2.base import L2TaskId
from kvbucket.l2.core import AdapterCore, log, repeated
from kvbucket.stores.base import Buffer


class LoadPath(AdapterCore):
    """Load tasks and their completions."""

    def submit_load_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        keys, buffers = list(keys), list(buffers)
        with self._lock:
            tid = self._new_id()
            if self._closed or len(keys) != len(buffers):
                self._load_done[tid] = [False] * len(keys)
            else:
                self._schedule(self._run_load(tid, keys, buffers, keepalive))
                return tid
        self._load_efd.notify()
        return tid

    def query_load_result(self, task_id: L2TaskId) -> list[bool] | None:
        with self._lock:
            return self._load_done.pop(task_id, None)

    async def _run_load(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        ok = [False] * n
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        try:
            cands = [self._names(k) for k in keys]
            with self._lock:
                # The name the index knows first, then the others in order.
                order = [_known_first(c, self._where(c)) for c in cands]
            todo = list(range(n))
            r = 0
            while todo:
                results = await self._sliced(
                    self._store.get_many, [order[i][r] for i in todo], [buffers[i] for i in todo]
                )
                retry: list[int] = []
                with self._lock:
                    for i, res in zip(todo, results, strict=True):
                        name = order[i][r]
                        if res.found:
                            ok[i] = True
                            self._index.touch(name)
                        elif isinstance(res.error, SizeMismatchError):
                            self._stats["size_mismatches"] += 1
                            repeated.warning("load task %d: %s; reported as a miss", tid, res.error, item=tid)
                        elif res.ok:  # not there (deleted elsewhere): forget it, try the next name
                            size = self._index.remove(name)
                            if size:
                                gone_keys.append(keys[i])
                                gone_sizes.append(size)
                                if self._fleet is not None:
                                    self._fleet.deleted([name])
                            if r + 1 < len(order[i]):
                                retry.append(i)
                        else:
                            self._last_error = str(res.error)
                todo, r = retry, r + 1
        except Exception as e:
            log.exception("load task %d failed", tid)
            self._last_error = f"{type(e).__name__}: {e}"
        self._stats["loads"] += 1
        self._stats["load_misses"] += ok.count(False)
        if gone_keys and self.listener is not None:
            self._tell(self.listener.on_keys_deleted, gone_keys, gone_sizes)
        with self._lock:
            self._load_done[tid] = ok
        self._load_efd.notify()


def _known_first(cands: tuple[str, ...], known: str | None) -> tuple[str, ...]:
    if known is None or known == cands[0]:
        return cands
    return (known, *(c for c in cands if c != known))
