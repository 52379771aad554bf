"""How an L2 adapter runs its tasks: one asyncio loop on a daemon thread, a bounded pool for the
store's blocking batch verbs, and one table of finished results per kind of task.

Callers (LMCache's controllers) hand a coroutine to the loop and return; the loop runs the
store's batch verbs on ``num_workers`` pool threads, splitting each batch into at most
``num_workers`` slices so one task uses the whole pool. Completion is a result put in a
:class:`Completions` table, then a write to its event fd.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from kvbucket.errors import StoreError
from kvbucket.l2.base import EventNotifier, L2TaskId
from kvbucket.l2.core import Stats, item_name, kind_of
from kvbucket.stores.base import ItemResult
from kvbucket.threads import DaemonThreadPool

T = TypeVar("T")


class TaskRunner:
    """The loop thread, the pool, and the futures in flight (``inflight``: a set whose single
    adds and discards are atomic; ``close`` waits for a snapshot of it)."""

    def __init__(self, num_workers: int, *, split_batches: bool, stats: Stats) -> None:
        self._num_workers = num_workers
        # Stores that run a batch's items concurrently themselves (S3, HF buckets) get whole
        # batches; others (a directory) get one slice per worker.
        self._split = split_batches
        self._stats = stats
        self._ids = itertools.count()  # next() on a count is atomic: ids are unique across threads
        self.inflight: set[Future[None]] = set()
        # Daemon workers: a store call stuck past close() never keeps the process alive. (Every
        # blocking call names this pool explicitly; asyncio only takes a ThreadPoolExecutor as
        # the loop's default executor.)
        self.pool = DaemonThreadPool(num_workers, "kvbucket-l2")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvbucket-l2-loop", daemon=True)
        self.thread.start()

    def new_id(self) -> L2TaskId:
        return next(self._ids)

    def schedule(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the loop; cheap and non-blocking, so callers may hold a lock."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.inflight.add(fut)
        fut.add_done_callback(self.inflight.discard)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result (never from the loop thread)."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("delete() must not be called from the adapter's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the loop thread (RuntimeError once the loop is closed)."""
        self.loop.call_soon_threadsafe(fn)

    async def sliced(
        self, fn: Callable[..., list[ItemResult]], names: Sequence[Any], extra: Sequence[Any] | None = None
    ) -> list[ItemResult]:
        """Call a batch verb over up to ``num_workers`` slices at once; a slice that raises
        becomes one error result per item (never a lost item)."""
        n = len(names)
        if n == 0:
            return []
        step = math.ceil(n / min(self._num_workers, n)) if self._split else n
        loop = asyncio.get_running_loop()
        futs = []
        for i in range(0, n, step):
            args = (
                (list(names[i : i + step]),)
                if extra is None
                else (list(names[i : i + step]), list(extra[i : i + step]))
            )
            futs.append(loop.run_in_executor(self.pool, fn, *args))
        parts = await asyncio.gather(*futs, return_exceptions=True)
        out: list[ItemResult] = []
        ok = True
        for i, part in zip(range(0, n, step), parts, strict=True):
            chunk = names[i : i + step]
            if isinstance(part, BaseException):
                err = part if isinstance(part, StoreError) else StoreError(f"{type(part).__name__}: {part}")
                self._stats.note_error(kind_of(fn), str(err))
                out.extend(ItemResult(item_name(x), error=err) for x in chunk)
                ok = False
            else:
                out.extend(part)
                ok = ok and all(r.error is None for r in part)
        if ok:
            self._stats.note_ok(kind_of(fn))
        return out

    def stop(self, until: float | None = None) -> None:
        """Stop the loop and the pool (after the caller waited for what it wanted finished), by
        ``until`` (a monotonic instant; None: up to 5 s for each step).

        Whatever still runs on the loop (a task past the caller's deadline, e.g. an eviction pass
        waiting on a hung delete) is cancelled and allowed to unwind first: a pending task
        dropped with its loop is asyncio's "Task was destroyed but it is pending!". Pool workers
        still stuck in a store call past ``until`` are left behind (daemon threads)."""

        def left(cap: float) -> float:
            return cap if until is None else max(0.0, min(cap, until - time.monotonic()))

        with contextlib.suppress(Exception):  # a loop already stopped, or unwinding past its time
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self.loop).result(timeout=left(5.0))
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=left(10.0))
        self.pool.shutdown(wait=True, cancel_futures=True, timeout=left(5.0))
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait until they have unwound."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Completions(Generic[T]):
    """Finished tasks of one kind (store, lookup or load) until the caller collects them, and the
    event fd that tells it. ``_lock`` guards ``_done`` only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[L2TaskId, T] = {}
        self._efd = EventNotifier()

    def publish(self, tid: L2TaskId, result: T) -> None:
        """Keep the result, then signal: a caller woken by the fd finds it."""
        with self._lock:
            self._done[tid] = result
        self._efd.notify()

    def pop(self, tid: L2TaskId) -> T | None:
        with self._lock:
            return self._done.pop(tid, None)

    def pop_all(self) -> dict[L2TaskId, T]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def fileno(self) -> int:
        return self._efd.fileno()

    def close(self) -> None:
        self._efd.close()
