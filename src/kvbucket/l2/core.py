"""Small parts every path of :class:`~kvbucket.l2.adapter.ObjectStoreL2Adapter` is handed: the
listener, the counters, the name cache, and the log.

None of them holds a lock: the name cache and the counters are plain dicts whose single
operations are atomic in CPython (a counter may be bumped with or without
:attr:`~kvbucket.l2.state.KeyState.lock` held, as before the split), and the listener is one
attribute read per call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvbucket.keys import ObjectKey
from kvbucket.l2.naming import Naming
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import Buffer

log = logging.getLogger("kvbucket.l2.adapter")
repeated = RepeatedLog(log)  # one line per kind of failure, with a count

_NAME_CACHE_MAX = 1 << 20


class L2Listener(Protocol):
    """Told about keys entering, being used, and leaving the store (LMCache's listeners)."""

    def on_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None: ...

    def on_keys_accessed(self, keys: list[ObjectKey]) -> None: ...

    def on_keys_deleted(self, keys: list[ObjectKey], sizes: list[int]) -> None: ...


def nbytes(buf: Buffer) -> int:
    return memoryview(buf).nbytes


def item_name(x: Any) -> str:
    return x[0] if isinstance(x, tuple) else str(x)


class Listeners:
    """The adapter's listener (replaceable at any time: ``adapter.listener = ...``); a listener's
    failure is logged, never lost work or a missing signal."""

    def __init__(self, listener: L2Listener | None) -> None:
        self.listener = listener

    def stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        if keys and self.listener is not None:
            self._tell(self.listener.on_keys_stored, keys, sizes)

    def accessed(self, keys: list[ObjectKey]) -> None:
        if keys and self.listener is not None:
            self._tell(self.listener.on_keys_accessed, keys)

    def deleted(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        if keys and self.listener is not None:
            self._tell(self.listener.on_keys_deleted, keys, sizes)

    @staticmethod
    def _tell(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("L2 listener %s failed", getattr(fn, "__name__", fn))


class Stats(dict[str, int]):
    """The counters ``report_status`` shows, and the last error any path saw: when it happened,
    and whether a store call has fully succeeded since (then it is history, not the state)."""

    def __init__(self) -> None:
        super().__init__(
            stores=0,
            store_failures=0,
            lookups=0,
            loads=0,
            load_misses=0,
            size_mismatches=0,
            refused_unfull=0,
            refused_full=0,
            evicted_keys=0,
            evicted_bytes=0,
            deleted_keys=0,
            delete_failures=0,
            foreign_objects=0,
            breaker_misses=0,  # keys a lookup answered as misses, unasked, while the breaker was open
            read_ahead_skipped=0,  # lookup hits not read ahead: LMCache did not load them from here last time
        )
        self._last_error: str | None = None
        self.last_error_at: float | None = None  # wall-clock seconds of the last error
        self._error_mono = 0.0  # the same moment on the monotonic clock (the breaker's)
        self.recovered = False  # a store call fully succeeded after the last error

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @last_error.setter
    def last_error(self, message: str | None) -> None:
        self._last_error = message
        self.last_error_at = time.time() if message is not None else None
        self._error_mono = time.monotonic()
        self.recovered = False

    def note_ok(self) -> None:
        """A store call answered every item without an error: the last error is past."""
        if self._last_error is not None:
            self.recovered = True

    def current_error(self, answered_at: float | None = None) -> str | None:
        """The error of now: None once a call succeeded after it, here (:meth:`note_ok`) or
        anywhere else on the store (``answered_at``: the store breaker's last answer, monotonic
        seconds; a lookup hit's read-ahead GET is the first request after an outage)."""
        if self._last_error is None or self.recovered:
            return None
        if answered_at is not None and answered_at > self._error_mono:
            self.recovered = True
            return None
        return self._last_error


class NameCache:
    """The names a key is read under, the written one first (see :mod:`kvbucket.l2.naming`).

    Encoding a name is a Python loop over its bytes; keys repeat (lookup, load, unlock), so the
    last ~million are remembered."""

    def __init__(self, naming: Naming) -> None:
        self.naming = naming
        self._cache: dict[ObjectKey, tuple[str, ...]] = {}

    def names(self, key: ObjectKey) -> tuple[str, ...]:
        names = self._cache.get(key)
        if names is None:
            names = self.naming.read_names(key)
            if len(self._cache) >= _NAME_CACHE_MAX:
                self._cache.clear()
            self._cache[key] = names
        return names

    def name(self, key: ObjectKey) -> str:
        """The name ``key`` is written under."""
        return self.names(key)[0]
