"""The state every part of :class:`~kvbucket.l2.adapter.ObjectStoreL2Adapter` shares, and the
small helpers its paths use (names, scheduling on the loop, sliced batch calls, listener calls).

Threads: callers (LMCache's controllers) only take ``_lock`` and hand a coroutine to an asyncio
loop running on a daemon thread; that loop runs the store's blocking batch verbs on a bounded
pool of ``num_workers`` threads, splitting each batch into at most ``num_workers`` slices so one
task uses the whole pool. Completion is a write to the matching event fd.

The adapter's verbs live in one module per path (:mod:`~kvbucket.l2.store_path`,
:mod:`~kvbucket.l2.lookup_path`, :mod:`~kvbucket.l2.load_path`, :mod:`~kvbucket.l2.removal`,
:mod:`~kvbucket.l2.inventory`), each a mixin over :class:`AdapterCore`; the attributes below are
set by the adapter's ``__init__``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from kvbucket.errors import StoreError
from kvbucket.keys import ObjectKey
from kvbucket.l2.accounting import KeyIndex
from kvbucket.l2.base import EventNotifier, L2Adapter, L2TaskId, StoreResult
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.l2.naming import Naming
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import Buffer, ItemResult, ObjectStore
from kvbucket.stores.breaker import CircuitBreaker
from kvbucket.threads import DaemonThreadPool

if TYPE_CHECKING:
    from kvbucket.fleet.host import FleetLink

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


class AdapterCore(L2Adapter):
    """Shared state and helpers; not used on its own."""

    _prefix: str
    _naming: Naming
    _store: ObjectStore
    _breaker: CircuitBreaker | None
    _num_workers: int
    _capacity: int
    _eviction: EvictionConfig | None
    _neg_ttl: float
    _full_fixed: int | None
    _full: dict[int, int]  # full chunk size per object group (kv_rank >> 32)
    _delete_timeout: float
    _split: bool
    listener: L2Listener | None
    _lock: threading.Lock
    _name_cache: dict[ObjectKey, tuple[str, ...]]
    _index: KeyIndex
    _locks: dict[str, int]  # name -> lock count
    _deleting: set[str]
    _storing: dict[str, int]  # names a store task is writing -> count
    _missing: dict[str, float]  # name -> monotonic expiry of a remembered miss
    _next_id: int
    _store_done: dict[L2TaskId, StoreResult]
    _lookup_done: dict[L2TaskId, list[bool]]
    _load_done: dict[L2TaskId, list[bool]]
    _inflight: set[Future[None]]
    _closed: bool
    _evicting: bool
    _rebuilt: bool
    _deleted_while_rebuilding: set[str]
    _stats: dict[str, int]
    _last_error: str | None
    _store_efd: EventNotifier
    _lookup_efd: EventNotifier
    _load_efd: EventNotifier
    _pool: DaemonThreadPool
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _fleet: FleetLink | None

    def _names(self, key: ObjectKey) -> tuple[str, ...]:
        """The names to read ``key`` under, the written one first (see :mod:`kvbucket.l2.naming`)."""
        # Encoding a name is a Python loop over its bytes; keys repeat (lookup, load, unlock), so
        # remember the last ~million.
        names = self._name_cache.get(key)
        if names is None:
            names = self._naming.read_names(key)
            if len(self._name_cache) >= _NAME_CACHE_MAX:
                self._name_cache.clear()
            self._name_cache[key] = names
        return names

    def _name(self, key: ObjectKey) -> str:
        """The name ``key`` is written under."""
        return self._names(key)[0]

    def _where(self, cands: tuple[str, ...]) -> str | None:
        """The first candidate name the index holds (call with ``_lock``)."""
        for c in cands:
            if c in self._index:
                return c
        return None

    def _new_id(self) -> L2TaskId:
        tid = self._next_id
        self._next_id += 1
        return tid

    def _schedule(self, coro: Any) -> None:
        """Run ``coro`` on the loop; called with or without ``_lock`` held (cheap, non-blocking)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)

    async def _sliced(
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
            futs.append(loop.run_in_executor(self._pool, fn, *args))
        parts = await asyncio.gather(*futs, return_exceptions=True)
        out: list[ItemResult] = []
        for i, part in zip(range(0, n, step), parts, strict=True):
            chunk = names[i : i + step]
            if isinstance(part, BaseException):
                err = part if isinstance(part, StoreError) else StoreError(f"{type(part).__name__}: {part}")
                self._last_error = str(err)
                out.extend(ItemResult(item_name(x), error=err) for x in chunk)
            else:
                out.extend(part)
        return out

    def _tell(self, fn: Callable[..., None], *args: Any) -> None:
        """Call a listener; its failure is logged, never lost work or a missing signal."""
        try:
            fn(*args)
        except Exception:
            log.exception("L2 listener %s failed", getattr(fn, "__name__", fn))

    def _maybe_evict(self) -> None:
        """Start an eviction pass if one is due (:class:`~kvbucket.l2.removal.RemovalPath`)."""
        raise NotImplementedError
