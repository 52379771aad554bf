"""A circuit breaker per remote store, applied once to every remote store's batch verbs.

When a store is hung or gone, every call costs its deadline. After ``failures`` consecutive
failed calls the breaker *opens*: calls answer at once, each item failing with
:class:`~kvbucket.errors.CircuitOpenError` (a lookup is then a miss for every caller, a store is
dropped and counted), without touching the network. After ``cooldown_secs`` it *half-opens*:
one call goes through as a probe; success closes the breaker, failure opens it for another
cooldown. (LMCache's breaker never closes again; this one does.)

A *failed call* is one that raised or had an item fail with a
:class:`~kvbucket.errors.TransientStoreError` (timeouts, deadlines, 5xx, refused
connections). Answers from a healthy server (missing objects, refused credentials, size
mismatches) are not failures. ``failures=0`` disables the breaker.

A call still running past its budget (``budgets``: seconds per operation, the store's own
deadlines, plus ``grace_secs``) counts as failed *then*, while its thread is still stuck (a
caller that gave up on it is not kept waiting, and the next lookups already see the breaker
open); when it finally ends it is not counted again. A watchdog thread per breaker, started with
the first call in flight and ended when idle or when the store closes (:meth:`CircuitBreaker.close`
ends it at once and waits for it: a closed store leaves no thread of its own behind), does this.
A caller with a shorter timeout of its own (``RemoteBackend``'s ``blocking_timeout_secs``)
reports the call it gave up on at once (:meth:`CircuitBreaker.abandoned`).

:class:`RemoteStore` is the one place this is applied: subclasses (``HFBucketStore``,
``S3Store``) get their ``put_many``/``get_many``/``head_many``/``delete_many`` wrapped. With the
breaker closed the wrapper costs an attribute test and a scan of the results for errors.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbucket.errors import CircuitOpenError, TransientStoreError
from kvbucket.stores.base import ItemResult, ObjectStore
from kvbucket.stores.deadline import start_refusal

log = logging.getLogger(__name__)

CLOSED = "closed"
HALF_OPEN = "half_open"
OPEN = "open"
#: The value of the ``kvbucket_store_breaker_state`` gauge for each state.
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}

_VERBS = ("put_many", "get_many", "head_many", "delete_many")
_OPS = {"put_many": "put", "get_many": "get", "head_many": "head", "delete_many": "delete"}


class _Call:
    """One call in flight: when it is overdue, and whether the watchdog already counted it."""

    __slots__ = ("counted", "due")

    def __init__(self, due: float) -> None:
        self.due = due
        self.counted = False


_WATCH_IDLE_SECS = 5.0  # a watchdog with no call in flight for this long ends (restarted on demand)


class CircuitBreaker:
    """Closed -> open after ``failures`` consecutive failed calls -> half-open after ``cooldown_secs``."""

    def __init__(
        self, store: str, *, failures: int = 5, cooldown_secs: float = 10.0,
        budgets: Mapping[str, float] | None = None, grace_secs: float = 0.25,
    ) -> None:
        if failures < 0 or cooldown_secs < 0 or grace_secs < 0:
            raise ValueError("breaker failures, cooldown_secs and grace_secs must not be negative")
        self.store = store  # a label safe to print (a store URL without credentials)
        self.failures = failures
        self.cooldown_secs = cooldown_secs
        #: seconds a call of each operation ("head", "get", "put", "delete") may take
        self.budgets = dict(budgets or {})
        self.grace_secs = grace_secs
        self.state = CLOSED
        #: monotonic seconds of the last call the store answered (report_status: an error before
        #: it is past); 0.0 before any
        self.answered_at = 0.0
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._calls: set[_Call] = set()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._publish()

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.store!r}, state={self.state}, failures={self.failures})"

    def allow(self) -> bool:
        """May a call go to the store now? (In half-open state: one probe at a time.)"""
        if self.state is CLOSED:
            return True
        with self._lock:
            if self.state is OPEN and time.monotonic() - self._opened_at >= self.cooldown_secs:
                self._set(HALF_OPEN)
            if self.state is HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return self.state is CLOSED

    def refusing(self) -> bool:
        """Would a call be refused right now (open, cooldown not over)? A read-only test that
        never claims the half-open probe: callers on the inference path use it to answer a miss
        without touching the store or hopping to another thread."""
        return self.state is OPEN and time.monotonic() - self._opened_at < self.cooldown_secs

    def record(self, failed: bool) -> None:
        """Count one finished call."""
        if not failed:
            self.answered_at = time.monotonic()
            if self._consecutive == 0 and self.state is CLOSED:
                return  # the hot path: nothing to change
            with self._lock:
                self._consecutive = 0
                self._probing = False
                if self.state is not CLOSED:
                    log.warning("store %s answers again: circuit breaker closed", self.store)
                    self._set(CLOSED)
            return
        if not self.failures:
            return
        with self._lock:
            self._consecutive += 1
            self._probing = False
            if self.state is HALF_OPEN or (self.state is CLOSED and self._consecutive >= self.failures):
                if self.state is CLOSED:
                    log.warning(
                        "store %s failed %d calls in a row: circuit breaker open; its lookups miss and "
                        "its stores are dropped for %gs, then one call probes it",
                        self.store, self._consecutive, self.cooldown_secs,
                    )
                self._opened_at = time.monotonic()
                self._set(OPEN)

    def begin(self, op: str) -> _Call | None:
        """Note a call of ``op`` starting; pass the answer to :meth:`end` when it is over."""
        budget = self.budgets.get(op)
        if budget is None or not self.failures:
            return None
        call = _Call(time.monotonic() + budget + self.grace_secs)
        with self._lock:
            if self._closed:  # the store refuses the call itself; nothing to watch
                return None
            self._calls.add(call)
            if self._watcher is not None:
                self._wake.notify()  # it may be waiting for a later deadline than this one
            else:
                self._watcher = threading.Thread(target=self._watch, name="kvbucket-breaker-watch",
                                                 daemon=True)
                self._watcher.start()
        return call

    def end(self, call: _Call | None, failed: bool) -> None:
        """Count a finished call, unless the watchdog counted it when it became overdue."""
        if call is not None:
            with self._lock:
                self._calls.discard(call)
                if call.counted:
                    return
        self.record(failed)

    def abandoned(self) -> None:
        """A caller stopped waiting for a call in flight (its own timeout, shorter than the
        store's deadline): count a failed call now. The oldest call still uncounted is marked
        counted, so that its late end is not counted again."""
        with self._lock:
            live = [c for c in self._calls if not c.counted]
            if live:
                min(live, key=lambda c: c.due).counted = True
        self.record(True)

    def close(self) -> None:
        """End the watchdog now (the store closes): it would otherwise outlive the store by up to
        the longest budget in flight plus the grace, or by its idle time. Calls still running are
        not counted any more; a call begun after this is not watched."""
        with self._lock:
            self._closed = True
            watcher, self._watcher = self._watcher, None
            self._wake.notify_all()
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()  # it only waits on the condition: it ends as soon as it runs

    def _watch(self) -> None:
        """Count each call still running past its budget as a failed call, once, at that moment."""
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                live = [c for c in self._calls if not c.counted]
                overdue = [c for c in live if c.due <= now]
                for c in overdue:
                    c.counted = True
                if not overdue:
                    if not live and not self._wake.wait(_WATCH_IDLE_SECS) and not self._calls:
                        if self._watcher is me:
                            self._watcher = None
                        return
                    if live:
                        self._wake.wait(min(c.due for c in live) - now)
                    continue
            log.debug("%d call(s) to %s still running past their deadline: counted as failed",
                      len(overdue), self.store)
            for _ in overdue:
                self.record(True)

    def _set(self, state: str) -> None:
        self.state = state
        if state is OPEN:
            from kvbucket.metrics import STORE_BREAKER_OPENS

            STORE_BREAKER_OPENS.labels(self.store).inc()
        self._publish()

    def _publish(self) -> None:
        from kvbucket.metrics import STORE_BREAKER_STATE

        STORE_BREAKER_STATE.labels(self.store).set(STATE_VALUES[self.state])

    def count_rejected(self, op: str, n: int) -> None:
        """Count ``n`` objects of ``op`` answered without the store because the breaker is open."""
        from kvbucket.metrics import STORE_BREAKER_REJECTED

        if n:
            STORE_BREAKER_REJECTED.labels(self.store, op).inc(n)

    def rejected(self, op: str, names: Sequence[str]) -> list[ItemResult]:
        """The answer of a call the open breaker refused: every item fails at once, counted."""
        self.count_rejected(op, len(names))
        err = CircuitOpenError(
            f"{self.store} failed {self.failures} calls in a row and is skipped (circuit breaker open; "
            f"it is probed again {self.cooldown_secs:g}s after opening): {op} not attempted"
        )
        return [ItemResult(n, error=err) for n in names]


def breaker_of(store: object) -> CircuitBreaker | None:
    """The circuit breaker of ``store`` (through sealing and format layers), or None."""
    b = getattr(store, "breaker", None)
    return b if isinstance(b, CircuitBreaker) else None


def call_failed(results: Sequence[ItemResult]) -> bool:
    """Did any item fail the way a sick store fails (timeout, deadline, 5xx, no connection)?"""
    for r in results:
        e = r.error
        if e is not None and isinstance(e, TransientStoreError) and not isinstance(e, CircuitOpenError):
            return True
    return False


def _guard(verb: str, fn: Callable[..., list[ItemResult]]) -> Callable[..., list[ItemResult]]:
    op = _OPS[verb]
    loads = verb == "get_many"

    @functools.wraps(fn)
    def guarded(self: RemoteStore, *args: Any, **kwargs: Any) -> list[ItemResult]:
        if loads and (args[1] if len(args) > 1 else kwargs.get("out")) is not None:
            # A load into caller buffers past its caller's start bound (backends/late_start.py):
            # refused before anything is asked, and not the store's health (the breaker is not told).
            late = start_refusal()
            if late is not None:
                return [ItemResult(n, error=late) for n in (args[0] if args else kwargs["names"])]
        breaker = self.breaker
        if breaker.state is not CLOSED and not breaker.allow():
            raw = args[0] if args else kwargs.get("items", kwargs.get("names", ()))
            names = self._names([n for n, _ in raw] if verb == "put_many" else raw)
            return breaker.rejected(op, names)
        call = breaker.begin(op)
        try:
            results = fn(self, *args, **kwargs)
        except TransientStoreError:
            breaker.end(call, True)
            raise
        except BaseException:
            breaker.end(call, False)  # bad arguments, a missing bucket: not the store's health
            raise
        breaker.end(call, call_failed(results))
        return results

    guarded.__kvbucket_guarded__ = True  # type: ignore[attr-defined]
    return guarded


class RemoteStore(ObjectStore):
    """An :class:`ObjectStore` over the network: its batch verbs pass through ``self.breaker``.

    Subclasses set ``self.breaker`` in ``__init__`` (see :func:`breaker_for`).
    """

    breaker: CircuitBreaker

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for verb in _VERBS:
            fn = cls.__dict__.get(verb)
            if fn is not None and not getattr(fn, "__kvbucket_guarded__", False):
                setattr(cls, verb, _guard(verb, fn))


__all__ = [
    "CLOSED", "HALF_OPEN", "OPEN", "STATE_VALUES", "CircuitBreaker", "RemoteStore", "breaker_of",
    "call_failed",
]
