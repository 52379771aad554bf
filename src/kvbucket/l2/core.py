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
    """The counters ``report_status`` shows, and the errors the paths saw, by kind of call: the
    newest (and when) for history, and those no success of their own kind has cleared since."""

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
        self._last_error: str | None = None  # the newest error of any kind (history once past)
        self.last_error_at: float | None = None  # wall-clock seconds of the last error
        # kind -> (message, monotonic moment) of errors no success of that kind has cleared yet
        self._open: dict[str, tuple[str, float]] = {}

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def note_error(self, kind: str, message: str) -> None:
        """A ``kind`` of store call (:data:`KINDS`) failed: the error of now until a call of the
        same kind succeeds (a read kind also clears on any answer of the store after it)."""
        self._last_error = message
        self.last_error_at = time.time()
        self._open[kind] = (message, time.monotonic())

    def note_ok(self, kind: str) -> None:
        """A ``kind`` of store call answered every item without an error: that kind's error is
        past. Only the same kind clears it: a listing or HEAD answering after a refused PUT says
        nothing about whether PUTs work (a read-only token answers both). Any success is an
        answer of the store, which clears a read kind's error (as :meth:`current_error` does)."""
        self._open.pop(kind, None)
        self.current_error(time.monotonic())

    def current_error(self, answered_at: float | None = None) -> str | None:
        """The newest error no success of its kind has cleared, or None. A read kind's error also
        clears once the store answered anything after it (``answered_at``: the breaker's last
        answer, monotonic seconds; a lookup hit's read-ahead GET is the first request after an
        outage); a write kind's (store, delete) only on a write of that kind succeeding."""
        if answered_at is not None:
            for kind, (_, at) in list(self._open.items()):
                if kind in READ_KINDS and answered_at > at:
                    self._open.pop(kind, None)
        if not self._open:
            return None
        return max(self._open.values(), key=lambda e: e[1])[0]


# Kinds of store call an adapter's errors are kept by: a success clears only its own kind's.
KINDS = ("store", "load", "lookup", "list", "delete")
READ_KINDS = frozenset({"load", "lookup", "list"})


def kind_of(fn: Callable[..., Any]) -> str:
    """The kind of a store batch verb, by name (``put_many`` -> store, ``head_many`` -> lookup)."""
    name = getattr(fn, "__name__", "")
    if name.startswith("put"):
        return "store"
    if name.startswith("delete"):
        return "delete"
    if name.startswith("head"):
        return "lookup"
    return "load"


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
