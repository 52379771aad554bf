"""A remote tier's read into a caller's buffers never starts too late to end before the tier
stops waiting for it.

Why: ``RemoteBackend`` waits ``blocking_timeout_secs`` for a store call, counted from when the
call is handed to its io threads, but the call may queue there behind other callers' calls. The
store's own load deadline (``load_timeout_secs`` of a Hub store, ``s3_load_timeout_secs`` of an
S3 store; past it the store's gates refuse every write into the buffers) starts only when the
call starts. A call started late ran past the tier's bound: ``get_into`` had returned False and
the store then wrote the chunk into a buffer the caller had taken back (an outside tester, Hub
and S3 at default settings, a store taking 3.5 s a chunk: 17 of 17 such buffers written).

**Invariant (a buffer is the caller's again when ``get_into`` returns).** A read into caller
buffers starts only while the store's whole load deadline, and :data:`GRACE_SECS` for the write
in progress at its end, fits before the tier's bound; a call that would start later is refused
without touching the buffers (its keys are misses). Enforced by :meth:`LateStart.guard`, the one
wrapper of those calls, for the call's first load, and at every remote store's ``get_many``
(stores/guard/breaker.py, the one wrapper of their batch verbs) for every further load the guard
layers make in the same call (``stores.deadline.LOAD_START_BY``, which the guard sets: a
read-ahead asked again after its own load failed ran a second load of up to 5 s past the tier's
bound, an outside tester's FAIL E). Stores without a known load deadline,
and a ``blocking_timeout_secs`` no longer than the store's, get no such guarantee
(docs/reliability.md says so).

Also here: the words of a call close() ended before it ran (:func:`closed_error`), a
``StoreError`` like every other failed read, so the tier answers it as a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from kvbucket.errors import StoreError, TransientStoreError
from kvbucket.stores.deadline import LOAD_START_BY

T = TypeVar("T")

#: Time allowed after the store's load deadline for the one write in progress to end.
GRACE_SECS = 0.5


def load_budget(store: Any) -> float | None:
    """The most a ``get_many`` of ``store`` writes into its buffers after it starts (its load
    deadline), or None when the store names none."""
    config = getattr(store, "config", None)
    for option in ("load_timeout_secs", "s3_load_timeout_secs"):
        value = getattr(config, option, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


class LateStart:
    """Refuses reads into caller buffers that would start too late (see the module's invariant)."""

    def __init__(self, store: Any, blocking_timeout_secs: float | None) -> None:
        self.budget = load_budget(store)
        self.room: float | None = None  # seconds a call may wait for an io thread
        if blocking_timeout_secs is not None and self.budget is not None:
            room = blocking_timeout_secs - self.budget - GRACE_SECS
            self.room = room if room > 0 else None

    def guard(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` for a call handed to the io threads now: it runs only if it starts in time."""
        room = self.room
        if room is None:
            return fn
        latest = time.monotonic() + room

        def run(*args: Any) -> T:
            waited = time.monotonic() - latest + room
            if waited > room:
                raise TransientStoreError(
                    f"a load waited {waited:.1f}s for one of this tier's io threads (io_threads, busy "
                    f"with other calls): too late to run the store's load deadline ({self.budget:g}s) "
                    "within blocking_timeout_secs, so it was not started and its buffers are untouched. "
                    "Raise io_threads, or blocking_timeout_secs"
                )
            # A further load in this call (a read-ahead asked again, an unsealed object read
            # whole) is held to the same instant: the stores check it (deadline.LOAD_START_BY).
            token = LOAD_START_BY.set(latest)
            try:
                return fn(*args)
            finally:
                LOAD_START_BY.reset(token)

        return run


def closed_error(call: str) -> StoreError:
    """The error of a tier's ``call`` that close() ended before it ran (nothing asked of the store)."""
    return StoreError(f"{call} was not run: the tier was closed (before an io thread took it)")


def submit_open(pool: Executor, call: str, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``pool.submit(fn, *args)``; a pool shut by close() is :func:`closed_error` (a StoreError:
    a read of a closed tier is a miss, as the docs say of reads), never a bare RuntimeError."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        raise closed_error(call) from None


__all__ = ["GRACE_SECS", "LateStart", "closed_error", "load_budget", "submit_open"]
