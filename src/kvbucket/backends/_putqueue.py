"""Non-blocking puts: a bounded queue drained by one worker thread.

Shared by the local and remote tiers. While a put is queued its chunk stays visible to the
owning backend (``pending``), so a ``get`` right after a non-blocking ``put`` finds it; a
``remove`` cancels a queued put and waits for one being applied, so a removed key can never
reappear because an older queued write landed after it.

The caller hands over its buffer: with ``blocking=False`` the chunk must not be modified
until the put has landed (``flush()``), exactly as with LMCache's non-blocking puts.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class PutQueue:
    """Apply ``apply(key, view)`` on a worker thread; ``submit`` blocks only when the queue is full."""

    def __init__(self, name: str, apply: Callable[[str, memoryview], None], maxsize: int = 64) -> None:
        if maxsize <= 0:
            raise ValueError("the put queue size must be positive")
        self._apply = apply
        self._q: queue.Queue[Any] = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._applying = threading.Lock()  # held while one put is being applied
        self._pending: dict[str, tuple[object, memoryview]] = {}
        self._closed = False
        self.failed = 0  # puts that raised on the worker (logged)
        self._thread = threading.Thread(target=self._run, name=f"kvbucket-put-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: str, view: memoryview) -> None:
        token = object()
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed; no more puts are accepted")
            self._pending[key] = (token, view)
        self._q.put((key, token))

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

    def flush(self) -> None:
        """Wait until every put submitted so far has landed (or failed and been logged)."""
        self._q.join()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._q.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is _STOP:
                    return
                key, token = item
                with self._applying:
                    with self._lock:
                        entry = self._pending.get(key)
                    if entry is None or entry[0] is not token:
                        continue  # removed, or superseded by a newer put of the same key
                    try:
                        self._apply(key, entry[1])
                    except Exception as e:
                        self.failed += 1
                        log.warning("non-blocking put of %s failed: %s", key, e)
                    finally:
                        with self._lock:
                            if self._pending.get(key, (None,))[0] is token:
                                del self._pending[key]
            finally:
                self._q.task_done()
