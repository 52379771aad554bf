"""Worker threads that never keep a process alive.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter exit, so
one worker stuck in a call that its client library cannot cancel (a socket that never answers, a
Xet upload commit waiting on a dead server) keeps the process alive for as long as that call
lasts: minutes, or forever. kvbucket's pools are :class:`DaemonThreadPool` instead: the same
``Executor`` interface, daemon workers, and a ``shutdown`` whose wait is bounded. A call still
running when the bound passes is abandoned (its thread ends with the call, or with the process).

Every thread kvbucket starts is a daemon and is named ``kvbucket-*``, so a test can tell its own
threads from the client libraries'.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

#: How long ``close()`` of a store or backend waits for calls in progress before abandoning them.
DEFAULT_CLOSE_TIMEOUT_SECS = 5.0

#: How long the interpreter's exit waits, in all, for calls still running on kvbucket's pools.
EXIT_DRAIN_SECS = 2.0

_STOP = object()
_counter = itertools.count()


class DaemonThreadPool(Executor):
    """A thread pool of at most ``max_workers`` daemon threads, started as work arrives."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "kvbucket-pool") -> None:
        if max_workers <= 0:
            raise ValueError("max_workers must be positive")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False
        # A pool dropped without shutdown() (a store never closed) ends its idle workers.
        self._finalizer = weakref.finalize(self, self._q.put, _STOP)
        _live.add(self)

    def _after_fork_in_child(self) -> None:
        """A forked child has none of the parent's workers, but the pool counted them (idle, so
        a submit started none and its work waited forever: a child loading through a store its
        parent had used timed out on every item). The child starts with no workers and a new
        queue; work queued in the parent at the fork is the parent's (its submitters are not in
        the child)."""
        self._finalizer.detach()
        self._q, self._idle = queue.SimpleQueue(), threading.Semaphore(0)
        self._threads, self._lock = [], threading.Lock()
        self._finalizer = weakref.finalize(self, self._q.put, _STOP)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._enqueue((fut, fn, args, kwargs))
        return fut

    def prestart(self, n: int | None = None) -> int:
        """Start up to ``n`` idle workers now (all ``max_workers`` by default); returns how many.

        Why: a worker is otherwise started by the submit that needs it, and ``Thread.start`` waits
        until the new thread holds the GIL, up to the 5 ms switch interval while other workers
        copy bytes. A store that puts 64 loads in flight at once paid that in its first batch, on
        the critical path, stretching one round trip into several; started when the store opens,
        the workers wait idle instead.
        """
        started = 0
        with self._lock:
            want = self._max if n is None else min(n, self._max)
            while not self._shutdown and len(self._threads) < want:
                t = threading.Thread(
                    target=_work, args=(self._q, self._idle, True),
                    name=f"{self._prefix}_{next(_counter)}", daemon=True,
                )
                t.start()
                self._threads.append(t)
                started += 1
        return started

    def hand_over(self, to: DaemonThreadPool) -> int:
        """Stop taking work and move the work still queued to ``to`` (the same futures); returns
        how many items moved. The workers leave once their current call ends.

        Why: a store replaces its pool when a call's deadline passes with workers stuck in calls
        that cannot be cancelled. Shutting the old pool with its queue cancelled failed the work
        other calls had queued there long before their own deadlines (an outside tester: loads at
        1.4 s of a 3 s budget), and a call submitting meanwhile was refused ("cannot schedule new
        futures after shutdown"); the Hub store then returned a load as closed while fetches it
        had already submitted still wrote into the caller's buffers. Queued work moved runs on
        ``to``; a caller refused here submits to the store's new pool (see the stores' ``_map``
        and ``submit_all``)."""
        with self._lock:
            self._shutdown = True
        moved = 0
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                to._enqueue(item)
                moved += 1
        self._q.put(_STOP)
        return moved

    def _enqueue(self, item: tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> None:
        """Queue ``item`` (a future and its call), starting a worker if none is idle."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._q.put(item)
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(  # the workers hold the queue, not the pool (see __init__)
                    target=_work, args=(self._q, self._idle), name=f"{self._prefix}_{next(_counter)}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None
    ) -> None:
        """Stop taking work; with ``wait``, wait for the workers at most ``timeout`` seconds.

        ``timeout=None`` means :data:`DEFAULT_CLOSE_TIMEOUT_SECS`: a shutdown never waits forever.
        """
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[0].cancel():
                    # notified too: concurrent.futures.wait() counts a future cancelled but not
                    # notified as pending, so a caller waiting on it waited to its own timeout
                    item[0].set_running_or_notify_cancel()
        self._q.put(_STOP)
        if wait:
            join_all(threads, DEFAULT_CLOSE_TIMEOUT_SECS if timeout is None else timeout)

    @property
    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)


_live: weakref.WeakSet[DaemonThreadPool] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [p._after_fork_in_child() for p in list(_live)])


@atexit.register
def _drain_at_exit() -> None:
    """At exit, let calls still running on pools nobody closed end, for at most EXIT_DRAIN_SECS.

    Daemon threads still inside a native call when the interpreter finalizes are ended when they
    next take the GIL; inside C++ frames that aborts the process ("terminate called without an
    active exception", seen in SGLang's processes with read-aheads still landing). Queued work
    is cancelled; a call that outlasts the bound is abandoned as before.
    """
    pools = list(_live)
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    join_all([t for pool in pools for t in pool.threads], EXIT_DRAIN_SECS)


def _work(q: queue.SimpleQueue[Any], idle: threading.Semaphore, start_idle: bool = False) -> None:
    if start_idle:  # prestarted: counted idle, so the next submit hands work to this worker
        idle.release()
    while True:
        item = q.get()
        if item is _STOP:
            q.put(_STOP)  # wake the next worker too
            return
        fut, fn, args, kwargs = item
        if fut.set_running_or_notify_cancel():
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller through the future
                fut.set_exception(e)
            else:
                fut.set_result(result)
        del fut, fn, args, kwargs, item  # drop references to results while idle
        idle.release()


def submit_current(pool: Callable[[], Executor], closed: Callable[[], bool], fn: Callable[..., T],
                   *args: Any, **kwargs: Any) -> Future[T]:
    """``fn(*args, **kwargs)`` submitted to the pool ``pool()`` names; one that refuses it because
    it was handed over meanwhile (:meth:`DaemonThreadPool.hand_over`) is replaced by the pool
    ``pool()`` names then. The refusal is raised once ``closed()``, or when no new pool came."""
    tried = None
    while True:
        p = pool()
        try:
            return p.submit(fn, *args, **kwargs)
        except RuntimeError:
            if closed() or p is tried:
                raise
            tried = p


def in_daemon_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run ``fn`` on a new daemon thread; its result (or exception) through the returned future.

    For background work nobody must wait for at ``close()`` (a store's one-off probe): a pool's
    bounded shutdown would still wait for it.
    """
    fut: Future[T] = Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered through the future
            fut.set_exception(e)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


class ForkSafeSemaphore:
    """A bounded semaphore of ``n`` that a forked child gets back whole.

    Why: a child inherits a semaphore as its parent's threads held it at the fork, but not those
    threads, so what they held is never released there. A Hub reader's parse turns and ranged-GET
    budget are held for a whole fetch: a process forking beside a load (a server starting its
    workers) left each child's loads waiting for turns until their deadline."""

    __slots__ = ("__weakref__", "_n", "_sem")

    def __init__(self, n: int) -> None:
        self._n = n
        self._sem = threading.BoundedSemaphore(n)
        _renewed_in_child.add(self)

    def acquire(self, timeout: float | None = None) -> bool:
        return self._sem.acquire(timeout=timeout)

    def release(self) -> None:
        self._sem.release()

    def free(self) -> int:
        """How many are not held (for tests and metrics)."""
        return self._sem._value  # type: ignore[attr-defined]

    def _renew(self) -> None:
        self._sem = threading.BoundedSemaphore(self._n)


_renewed_in_child: weakref.WeakSet[ForkSafeSemaphore] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [s._renew() for s in list(_renewed_in_child)])


def join_all(threads: list[threading.Thread], timeout: float) -> bool:
    """Join ``threads`` within one overall ``timeout``; True when all of them ended."""
    deadline = time.monotonic() + timeout
    for t in threads:
        if t is threading.current_thread():
            continue
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads if t is not threading.current_thread())


__all__ = ["DEFAULT_CLOSE_TIMEOUT_SECS", "DaemonThreadPool", "in_daemon_thread", "join_all"]
