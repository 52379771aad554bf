"""Non-blocking puts: a bounded queue drained by one worker thread.

Shared by the local and remote tiers. While a put is queued its chunk stays visible to the
owning backend (``pending``), so a ``get`` right after a non-blocking ``put`` finds it; a
``remove`` cancels a queued put and waits for one being applied, so a removed key can never
reappear because an older queued write landed after it.

``close()`` lets queued puts land, within ``drain_timeout_secs`` (a put stuck on a hung store
must not hold up ``close()`` or process exit: past the bound the rest are dropped, counted in
``dropped`` and logged; the worker is a daemon thread).

``flush(timeout)`` waits for the puts submitted so far, at most ``timeout`` seconds
(:data:`DEFAULT_FLUSH_TIMEOUT_SECS` unless told), and says what did not land: a
:class:`FlushResult` counting the puts still pending at the timeout and those that failed since
the last flush. It is true only when every one of them landed; nothing pending or failed is ever
reported as stored.

A full queue (the store is slower than the engine, or hung) holds a non-blocking put at most
``full_wait_secs`` (:data:`DEFAULT_FULL_WAIT_SECS`); past that the put is dropped, counted in
``dropped_full``, logged once per kind, and ``submit`` raises :class:`PutQueueFullError`, so the
engine's store path never stalls for a sick store and nothing dropped is reported as stored.

The caller hands over its buffer: with ``blocking=False`` the chunk must not be modified
until the put has landed (a true ``flush()``), exactly as with LMCache's non-blocking puts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbucket.backends.base import DEFAULT_FLUSH_TIMEOUT_SECS, FlushResult
from kvbucket.errors import TransientStoreError
from kvbucket.log_once import RepeatedLog

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count

_STOP = object()
#: How long ``close()`` waits for queued puts to land before dropping the rest.
DEFAULT_DRAIN_TIMEOUT_SECS = 30.0
#: How long a non-blocking put waits for room in a full queue before it is dropped.
DEFAULT_FULL_WAIT_SECS = 1.0


class PutQueueFullError(TransientStoreError):
    """A non-blocking put found the queue full for ``full_wait_secs``: dropped, not stored."""


class PutQueue:
    """Apply ``apply(key, view)`` on a worker thread; ``submit`` waits only while the queue is full,
    at most ``full_wait_secs`` (None: until there is room)."""

    def __init__(self, name: str, apply: Callable[[str, memoryview], None], maxsize: int = 64,
                 full_wait_secs: float | None = DEFAULT_FULL_WAIT_SECS) -> None:
        if maxsize <= 0:
            raise ValueError("the put queue size must be positive")
        if full_wait_secs is not None and full_wait_secs < 0:
            raise ValueError("full_wait_secs must be >= 0 (or None to wait for room)")
        self.full_wait_secs = full_wait_secs
        self._apply = apply
        self._q: queue.Queue[Any] = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._applying = threading.Lock()  # held while one put is being applied
        self._pending: dict[str, tuple[object, memoryview]] = {}
        self._closed = False
        # Flush bookkeeping: puts are numbered as submitted and finish in that order (one worker).
        # Numbering and enqueueing happen under one lock, so concurrent submitters cannot enqueue
        # out of order (a flush would then wait for a number already passed, until its timeout).
        # Not ``_lock``: a put blocked on a full queue must not keep the worker from ``_lock``.
        self._enqueue = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._submitted = 0
        self._finished = 0
        self._failed_seen = 0  # ``failed`` as last reported by a flush
        self.failed = 0  # puts that raised on the worker (logged)
        self.dropped = 0  # queued puts abandoned by a close() that hit its bound (logged)
        self.dropped_full = 0  # puts refused because the queue stayed full (logged)
        self._name = name
        self._thread = threading.Thread(target=self._run, name=f"kvbucket-put-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: str, view: memoryview) -> None:
        """Queue a put; :class:`PutQueueFullError` when no room came within ``full_wait_secs``."""
        token = object()
        wait = self.full_wait_secs
        deadline = None if wait is None else time.monotonic() + wait
        if not self._enqueue.acquire(timeout=-1 if wait is None else wait):
            self._drop_full(key)  # submitters ahead of this one are still waiting for room
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the backend is closed; no more puts are accepted")
                self._pending[key] = (token, view)
                seq = self._submitted + 1
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._q.put((key, token, seq), timeout=left)
            except queue.Full:
                with self._lock:
                    if self._pending.get(key, (None,))[0] is token:
                        del self._pending[key]
                self._drop_full(key)
            with self._lock:
                self._submitted = seq  # numbered only once queued: no gap a flush could wait on
        finally:
            self._enqueue.release()

    def _drop_full(self, key: str) -> None:
        with self._lock:
            self.dropped_full += 1
        _repeated.warning(
            "the %s tier's put queue stayed full for %gs (a slow or hung store?); put of %s dropped",
            self._name, self.full_wait_secs, key, item=key,
        )
        raise PutQueueFullError(
            f"the {self._name} tier's put queue stayed full for {self.full_wait_secs:g}s; "
            f"put of {key} dropped (not stored)"
        )

    def pending(self, key: str) -> memoryview | None:
        with self._lock:
            entry = self._pending.get(key)
        return None if entry is None else entry[1]

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def cancel(self, key: str) -> bool:
        """Drop a queued put of ``key`` and wait for one in progress; True if one was queued."""
        with self._lock:
            dropped = self._pending.pop(key, None) is not None
        with self._applying:
            pass
        return dropped

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_SECS) -> FlushResult:
        """Wait until every put submitted so far has finished, at most ``timeout`` seconds
        (None: no bound); see :class:`FlushResult` for what the answer counts."""
        with self._done:
            target = self._submitted
            finished = self._done.wait_for(lambda: self._finished >= target, timeout)
            pending = 0 if finished else target - self._finished
            # Failures since the last flush (one of a put submitted during the wait may be counted
            # here: reported failed, never stored).
            failed = self.failed - self._failed_seen
            self._failed_seen = self.failed
        if pending:
            log.warning(
                "flush of the %s tier: %d queued put(s) had not landed after %gs (a hung store?); "
                "they are not stored yet", self._name, pending, timeout,
            )
        return FlushResult(pending, failed)

    def close(self, drain_timeout_secs: float = DEFAULT_DRAIN_TIMEOUT_SECS) -> None:
        """Let queued puts land, within ``drain_timeout_secs``; drop (count, log) the rest."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + drain_timeout_secs
        with contextlib.suppress(queue.Full):  # the worker is stuck and the queue full: drop below
            self._q.put(_STOP, timeout=max(0.001, drain_timeout_secs))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            with self._lock:
                dropped = len(self._pending)
                self._pending.clear()  # the worker skips what is no longer pending
            self.dropped += dropped
            log.warning(
                "closing the %s tier: queued puts did not land within %gs; %d dropped (a put stuck "
                "on the store is abandoned; it never holds up the process)",
                self._name, drain_timeout_secs, dropped,
            )

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is _STOP:
                    return
                key, token, _ = item
                with self._applying:
                    with self._lock:
                        entry = self._pending.get(key)
                    if entry is None or entry[0] is not token:
                        continue  # removed, or superseded by a newer put of the same key
                    try:
                        self._apply(key, entry[1])
                    except Exception as e:
                        with self._lock:
                            self.failed += 1
                        _repeated.warning("non-blocking put of %s failed: %s", key, e, item=key)
                    finally:
                        with self._lock:
                            if self._pending.get(key, (None,))[0] is token:
                                del self._pending[key]
            finally:
                if item is not _STOP:
                    with self._done:
                        self._finished = item[2]
                        self._done.notify_all()
                self._q.task_done()
