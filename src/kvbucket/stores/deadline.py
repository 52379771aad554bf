"""Time budgets for remote store calls: a deadline per call, work past it abandoned safely.

A KV cache sits on the inference path, so every verb of a remote store has a total budget
(``lookup_timeout_secs``, ``load_timeout_secs``, ``store_timeout_secs`` and their ``s3_``
twins). Deadlines are absolute :func:`time.monotonic` instants passed down explicitly (no
thread-locals on the hot path). What a client library cannot cancel (an hf_xet upload commit,
a stream read, an obstore request) runs on a daemon thread and is *abandoned* at the deadline:
the caller gets :class:`DeadlineExceededError` for those items at once, and a :class:`Gate`
makes sure abandoned work never writes into a caller's buffer afterwards.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from contextvars import ContextVar
from typing import Any, TypeVar

from kvbucket.errors import DeadlineExceededError, TransientStoreError
from kvbucket.threads import in_daemon_thread

T = TypeVar("T")
log = logging.getLogger(__name__)


def deadline_in(secs: float) -> float:
    """The monotonic instant ``secs`` from now."""
    return time.monotonic() + secs


def left(deadline: float) -> float:
    """Seconds left before ``deadline`` (never negative)."""
    return max(0.0, deadline - time.monotonic())


def exceeded(what: str, where: str, option: str, secs: float) -> DeadlineExceededError:
    """The error of an item whose call ran out of time; it names the option that sets the budget."""
    return DeadlineExceededError(
        f"{what} on {where} did not finish within {option}={secs:g}s; reported failed (nothing of it "
        f"is counted). Check that the store is reachable, or raise {option}"
    )


#: The latest monotonic instant a load into caller buffers may start in this context: set by a
#: caller that stops waiting at its own bound (kvbucket.backends.late_start, whose invariant it
#: serves) and checked at every remote store's ``get_many`` into buffers (guard/breaker.py, the
#: one wrapper of their batch verbs), so that a guard layer's further load in the same call (a
#: read-ahead asked again, an unsealed object read whole) is held to it as the first load is.
LOAD_START_BY: ContextVar[float | None] = ContextVar("kvbucket_load_start_by", default=None)


def start_refusal() -> TransientStoreError | None:
    """The error of a load into caller buffers that would start past :data:`LOAD_START_BY`."""
    by = LOAD_START_BY.get()
    if by is None or time.monotonic() <= by:
        return None
    return TransientStoreError(
        "a further load of this call would start too late to end before its caller stops waiting "
        "(blocking_timeout_secs less the store's load deadline): not started, its buffers untouched")


class Abandoned(Exception):
    """Raised inside abandoned work when it tries to write into a caller's buffer."""


class Gate:
    """Lets work write into a caller's buffer only until the caller gives up on it.

    The caller calls :meth:`close` when the deadline passes; a write in progress finishes first,
    and every later write raises :class:`Abandoned` instead of touching the buffer (which the
    caller may already have reused). ``on_close``, when set by the work, is called then to stop
    the transfer itself (e.g. cancel an hf_xet stream).
    """

    __slots__ = ("_lock", "on_close", "open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = True
        self.on_close: Callable[[], Any] | None = None

    def write(self, view: memoryview, start: int, data: Any) -> None:
        with self._lock:
            if not self.open:
                raise Abandoned("the caller stopped waiting for this read")
            view[start : start + len(data)] = data

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)``, a write into the caller's buffer done in place (a decoder writing
        straight into it), while holding the gate, as :meth:`write` does."""
        with self._lock:
            if not self.open:
                raise Abandoned("the caller stopped waiting for this read")
            return fn(*args)

    def close(self) -> None:
        with self._lock:
            self.open = False
        stop = self.on_close
        if stop is not None:
            try:
                stop()
            except Exception:  # best effort: the gate already keeps the buffer safe
                log.debug("stopping an abandoned transfer failed", exc_info=True)


def wait_all(futures: Sequence[Future[Any]], deadline: float) -> bool:
    """Wait for ``futures`` until ``deadline``; True when all of them are done."""
    if not futures:
        return True
    _, pending = wait_futures(futures, timeout=left(deadline))
    return not pending


def run_abandonable(fn: Callable[[], T], deadline: float, on_timeout: Callable[[], Exception]) -> T:
    """Run ``fn`` on a daemon thread and return its result, or raise ``on_timeout()`` at ``deadline``.

    For calls a client library cannot cancel: past the deadline the thread is left to finish on
    its own (or to die with the process; it never keeps the process alive).
    """
    fut = in_daemon_thread(fn, "kvbucket-abandonable")
    try:
        return fut.result(timeout=left(deadline))
    except FutureTimeout:
        raise on_timeout() from None


class Watch:
    """One request's socket, ended by the reaper at ``deadline`` (see :class:`SocketReaper`)."""

    __slots__ = ("deadline", "done", "fired", "sock")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.sock: socket.socket | None = None
        self.fired = False  # the deadline passed with the request still running: the socket is dead
        self.done = False


class SocketReaper:
    """Ends a request's blocking socket calls at its deadline: one daemon thread per process
    shuts down each watched socket whose deadline passed.

    The deadline rule (docs/reliability.md): every request has a total deadline, not only
    per-read timeouts. A socket timeout bounds one recv, so a server that trickles a byte every
    0.2 s never trips it (a 2 KiB answer then takes minutes). Shut down, the socket's blocked
    call returns at once and the request fails; the connection is discarded, never reused.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._done_in_heap = 0
        self._seq = itertools.count()
        self._pid = -1  # the process whose thread runs (a forked child starts its own)

    def watch(self, deadline: float) -> Watch:
        w = Watch(deadline)
        with self._cv:
            if self._pid != os.getpid():
                self._pid, self._heap, self._done_in_heap = os.getpid(), [], 0
                threading.Thread(target=self._run, name="kvbucket-socket-reaper", daemon=True).start()
            heapq.heappush(self._heap, (deadline, next(self._seq), w))
            if self._heap[0][2] is w:
                self._cv.notify()
        return w

    def attach(self, w: Watch, sock: socket.socket | None) -> None:
        """The socket the request now uses (after connecting); shut at once if already late."""
        with self._cv:
            w.sock = sock
            late = w.fired and not w.done
        if late and sock is not None:
            _shut(sock)

    def release(self, w: Watch) -> bool:
        """The request is over (answered or failed): its socket is no longer watched. True when
        the reaper took it first (it may shut the socket after this returns).

        **Invariant (a kept connection is never shut under its next request).** A caller puts a
        connection back for reuse only when this returns False: the answer is read under the
        lock that the reaper takes to pick due sockets, and a watch released first is never
        picked. A ``fired`` read before this call is not enough: the reaper may pick the watch in
        between and shut the socket once another request has it."""
        with self._cv:
            fired = w.fired
            w.done = True
            self._done_in_heap += 1
            if self._done_in_heap > 4096 and 2 * self._done_in_heap > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].done]  # drop the finished ones
                heapq.heapify(self._heap)
                self._done_in_heap = 0
        return fired

    def _run(self) -> None:
        while True:
            with self._cv:
                due: list[socket.socket] = []
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, w = heapq.heappop(self._heap)
                    if w.done:
                        self._done_in_heap = max(0, self._done_in_heap - 1)
                        continue
                    w.fired = True
                    if w.sock is not None:
                        due.append(w.sock)
                if not due:
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for sock in due:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    """End the socket's blocked calls: its reads return the end of the stream (or an error).

    A TLS socket's connection is shut under it, not through ``SSLSocket.shutdown``, which also
    drops the TLS state: its later reads then returned the raw records still queued on the
    socket (Linux hands queued bytes out after a shutdown), and the Xet reader parsed them as
    chunks ("a fetched chunk is not a valid LZ4 frame": an outside tester's loads through a TLS
    relay, cut at their deadline). Shut under it, the reads decrypt what was queued, then end."""
    with contextlib.suppress(OSError):  # already closed
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


#: The process's reaper (its thread starts with the first watched request).
REAPER = SocketReaper()


__all__ = [
    "REAPER", "Abandoned", "Gate", "SocketReaper", "Watch", "deadline_in", "exceeded", "left",
    "run_abandonable", "wait_all",
]
