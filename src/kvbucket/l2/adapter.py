"""One L2 adapter implementation over any :class:`~kvbucket.stores.base.ObjectStore`.

Threads: callers (LMCache's controllers) only take a lock and hand a coroutine to an asyncio
loop running on a daemon thread; that loop runs the store's blocking batch verbs on a bounded
``ThreadPoolExecutor(num_workers)``, splitting each batch into at most ``num_workers`` slices so
one task uses the whole pool. Completion is a write to the matching event fd.

What it knows about the store lives in a :class:`~kvbucket.l2.accounting.KeyIndex` rebuilt
from the store's listing at start (in the background) and kept exact afterwards:

- lookups answer from the index when they can, so a hit costs no request; unknown keys are
  asked with one ``head_many`` and a miss is remembered for ``metadata_cache_ttl_secs``
  (objects written by another server show up after that long at most);
- a load that finds an object gone removes it from the index (self-healing when another
  server deleted it); a size unlike the caller's buffer is a miss and the buffer is untouched;
- a store whose batch partly failed asks the store (``head_many``) which objects landed and
  counts exactly those.

Sizes: a store task takes buffers of any sizes, mixed (as LMCache's adapters do), unless
``full_chunk_bytes`` is given, which refuses every other size. Lookups count an object as a
hit when its size is the full size, known from ``full_chunk_bytes`` or from the layout passed
with a lookup (LMCache's ``MemoryLayoutDesc``; the LMCache shim computes it, per object
group), or, with neither, when it is not empty. A load fills the caller's buffer only from an
object of exactly the buffer's size.

Names: :class:`~kvbucket.l2.naming.Naming` gives the name a key is written under and the
names it is read under (kvbucket's, then LMCache's built-in adapter's for the same store), so
a bucket LMCache filled is read as is.

Listener events: stored and deleted keys are told before the task's completion is signalled
(as LMCache's adapters do for stores); accessed keys (a lookup hit) right after the lookup's
signal, as LMCache's hfbucket and s3 adapters do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from kvbucket.errors import InvalidKeyError, SizeMismatchError, StoreError
from kvbucket.fleet.layout import is_fleet_name
from kvbucket.keys import ObjectKey
from kvbucket.l2.accounting import KeyIndex
from kvbucket.l2.base import EventNotifier, KeyPage, L2Adapter, L2TaskId, StoreResult, Usage
from kvbucket.l2.eviction import EvictionConfig, choose_victims
from kvbucket.l2.format_store import route_formats
from kvbucket.l2.naming import Naming
from kvbucket.log_once import RepeatedLog, flush_all
from kvbucket.stores.base import Buffer, ItemResult, ObjectStore, check_prefix
from kvbucket.stores.sealed import seal_store
from kvbucket.threads import DaemonThreadPool

if TYPE_CHECKING:
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.fleet.host import FleetLink

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count

_REBUILD_PAGE = 1000
_NAME_CACHE_MAX = 1 << 20


class L2Listener(Protocol):
    """Told about keys entering, being used, and leaving the store (LMCache's listeners)."""

    def on_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None: ...

    def on_keys_accessed(self, keys: list[ObjectKey]) -> None: ...

    def on_keys_deleted(self, keys: list[ObjectKey], sizes: list[int]) -> None: ...


def _nbytes(buf: Buffer) -> int:
    return memoryview(buf).nbytes


class ObjectStoreL2Adapter(L2Adapter):
    """See the module docstring. Build one with :func:`kvbucket.l2.open_l2_adapter` or directly."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        prefix: str = "",
        num_workers: int = 4,
        max_capacity_bytes: int = 0,
        eviction: EvictionConfig | None = None,
        metadata_cache_ttl_secs: float = 30.0,
        full_chunk_bytes: int | None = None,
        owns_store: bool = True,
        rebuild_usage: bool = True,
        delete_timeout_secs: float = 30.0,
        listener: L2Listener | None = None,
        split_batches: bool = True,
        naming: Naming | None = None,
        work_dir: Any = None,
        unsealed: str = "miss",
        encryption: Any = None,
        fleet: FleetConfig | None = None,
    ) -> None:
        """``fleet``: share capacity, eviction and visibility with every other node on this
        prefix through the store (see :mod:`kvbucket.fleet`); usage is then rebuilt from the
        fleet's snapshot and journals instead of a listing."""
        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        self._prefix = check_prefix(prefix)
        self._naming = naming if naming is not None else Naming(self._prefix)
        if self._naming.prefix != self._prefix:
            raise ValueError("naming and adapter prefixes differ")
        # Every write under kvbucket's names goes through SealedStore.put_many (one function:
        # SealedStore.seal) and every such load is verified there; refused objects come back as
        # misses (then forgotten). LMCache's names hold LMCache's raw bytes (kvbucket.l2.format_store).
        self._store = route_formats(
            seal_store(store, tier="l2", unsealed=unsealed, encryption=encryption), self._naming
        )
        # A per-process working dir (LMCache's download session dir), removed on close.
        self._work_dir = work_dir
        self._num_workers = num_workers
        self._capacity = int(max_capacity_bytes)
        self._eviction = eviction
        self._neg_ttl = float(metadata_cache_ttl_secs)
        # Full chunk size per object group (``kv_rank >> 32``, see kvbucket.integrations.lmcache).
        self._full_fixed = full_chunk_bytes
        self._full: dict[int, int] = {}
        self._owns_store = owns_store
        self._delete_timeout = delete_timeout_secs
        # Stores that run a batch's items concurrently themselves (S3, HF buckets) get whole
        # batches; others (a directory) get one slice per worker.
        self._split = split_batches
        self.listener = listener

        self._lock = threading.Lock()
        self._name_cache: dict[ObjectKey, tuple[str, ...]] = {}
        self._index = KeyIndex()
        self._locks: dict[str, int] = {}
        self._deleting: set[str] = set()
        # Names a store task is writing: the startup listing leaves them to the task, which
        # reports them to the listener as stored.
        self._storing: dict[str, int] = {}
        self._missing: dict[str, float] = {}  # name -> monotonic expiry of a remembered miss
        self._next_id = 0
        self._store_done: dict[L2TaskId, StoreResult] = {}
        self._lookup_done: dict[L2TaskId, list[bool]] = {}
        self._load_done: dict[L2TaskId, list[bool]] = {}
        self._inflight: set[Future[None]] = set()
        self._closed = False
        self._evicting = False
        self._rebuilt = not rebuild_usage and fleet is None
        self._deleted_while_rebuilding: set[str] = set()
        self._stats = {
            "stores": 0,
            "store_failures": 0,
            "lookups": 0,
            "loads": 0,
            "load_misses": 0,
            "size_mismatches": 0,
            "refused_unfull": 0,
            "refused_full": 0,
            "evicted_keys": 0,
            "evicted_bytes": 0,
            "deleted_keys": 0,
            "delete_failures": 0,
            "foreign_objects": 0,
        }
        self._last_error: str | None = None

        self._store_efd = EventNotifier()
        self._lookup_efd = EventNotifier()
        self._load_efd = EventNotifier()

        # Daemon workers: a store call stuck past close() never keeps the process alive. (Every
        # blocking call names this pool explicitly; asyncio only takes a ThreadPoolExecutor as
        # the loop's default executor.)
        self._pool = DaemonThreadPool(num_workers, "kvbucket-l2")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvbucket-l2-loop", daemon=True)
        self._thread.start()
        self._fleet: FleetLink | None = None
        if fleet is not None:
            from kvbucket.fleet.host import FleetLink

            if self._eviction is None:  # max_age works without a capacity
                self._eviction = EvictionConfig(eviction_policy="LRU" if self._capacity > 0 else "noop")
            self._fleet = FleetLink(self, fleet)
        elif rebuild_usage:
            self._schedule(self._rebuild())

    # ---- small helpers ------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        return self._store

    @property
    def naming(self) -> Naming:
        return self._naming

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

    def _full_for(self, key: ObjectKey) -> int | None:
        return self._full_fixed if self._full_fixed is not None else self._full.get(key.kv_rank >> 32)

    def _usable(self, key: ObjectKey, size: int) -> bool:
        full = self._full_for(key)
        return size > 0 and (full is None or size == full)

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
                out.extend(ItemResult(_item_name(x), error=err) for x in chunk)
            else:
                out.extend(part)
        return out

    # ---- event fds --------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---- store ------------------------------------------------------------------------------
    def submit_store_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        """``keepalive``: objects owning the buffers' memory, held until the task completes (a
        ctypes view of an LMCache MemoryObj does not keep the MemoryObj alive)."""
        keys, buffers = list(keys), list(buffers)
        with self._lock:
            tid = self._new_id()
            if self._closed or len(keys) != len(buffers):
                if len(keys) != len(buffers):
                    log.error("store task %d: %d keys but %d buffers; refused", tid, len(keys), len(buffers))
                self._store_done[tid] = StoreResult.failed(len(keys))
                failed_now = True
            else:
                failed_now = False
                self._schedule(self._run_store(tid, keys, buffers, keepalive))
        if failed_now:
            self._store_efd.notify()
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, StoreResult]:
        with self._lock:
            done, self._store_done = self._store_done, {}
        return done

    async def _run_store(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        new_keys: list[ObjectKey] = []
        new_sizes: list[int] = []
        try:
            sizes = [_nbytes(b) for b in buffers]
            # Any sizes, mixed in one task, as LMCache's adapters store them; only a configured
            # full_chunk_bytes refuses other sizes.
            fixed = self._full_fixed
            take = [i for i in range(n) if fixed is None or sizes[i] == fixed]
            if len(take) < n:
                self._stats["refused_unfull"] += n - len(take)
                log.warning(
                    "store task %d: refused %d chunk(s) whose size is not full_chunk_bytes=%d",
                    tid,
                    n - len(take),
                    fixed,
                )
            if self._fleet is not None and take:
                # The fleet's write cap: past it, a store fails like a full disk (docs/fleet.md).
                kept = self._fleet.admit([sizes[i] for i in take])
                if kept < len(take):
                    self._stats["refused_full"] += len(take) - kept
                    take = take[:kept]
            items = {i: self._naming.write_item(keys[i], buffers[i]) for i in take}
            names = {i: item[0] for i, item in items.items()}
            with self._lock:
                for nm in names.values():
                    self._storing[nm] = self._storing.get(nm, 0) + 1
            try:
                results = await self._sliced(self._store.put_many, [items[i] for i in take])
            except BaseException:
                self._unmark_storing(names.values())
                raise
            landed: dict[int, int] = {}
            failed: list[int] = []
            for i, r in zip(take, results, strict=True):
                if r.ok:
                    landed[i] = r.size if r.size is not None else sizes[i]
                else:
                    failed.append(i)
            if failed:
                # Remote batches are not transactional: ask which objects are there now.
                first_error = results[take.index(failed[0])].error
                _repeated.warning(
                    "store task %d: %d of %d puts failed (%s); checking what landed",
                    tid,
                    len(failed),
                    len(take),
                    first_error,
                    same=f"store puts failed: {first_error}",
                )
                heads = await self._sliced(self._store.head_many, [names[i] for i in failed])
                present: dict[int, int] = {}  # there, but not what we wrote (an older object)
                for i, h in zip(failed, heads, strict=True):
                    if h.found and h.size == sizes[i]:
                        landed[i] = h.size
                    elif h.found and h.size:
                        present[i] = h.size
                with self._lock:
                    for i, size in present.items():
                        if names[i] not in self._deleting:
                            self._index.add(names[i], keys[i], size, touch=False)
            with self._lock:
                self._unmark_storing_locked(names.values())
                for i, size in landed.items():
                    self._missing.pop(names[i], None)
                    if names[i] in self._deleting:
                        continue
                    was_new = names[i] not in self._index
                    self._index.add(names[i], keys[i], size)
                    if was_new:
                        new_keys.append(keys[i])
                        new_sizes.append(size)
                if self._fleet is not None:
                    self._fleet.stored([names[i] for i in landed], landed.values())
            ok = len(landed) == n
            result = StoreResult(ok, sum(landed.values()), tuple(i in landed for i in range(n)))
        except Exception as e:
            log.exception("store task %d failed", tid)
            self._last_error = f"{type(e).__name__}: {e}"
            result = StoreResult.failed(n)
        self._stats["stores"] += 1
        if not result.success:
            self._stats["store_failures"] += 1
        # LMCache's adapters tell the listener BEFORE signalling the completion, so a controller
        # woken by the signal finds its listener already told.
        if new_keys and self.listener is not None:
            self._tell(self.listener.on_keys_stored, new_keys, new_sizes)
        with self._lock:
            self._store_done[tid] = result
        self._store_efd.notify()
        self._maybe_evict()

    def _unmark_storing(self, names: Any) -> None:
        with self._lock:
            self._unmark_storing_locked(names)

    def _unmark_storing_locked(self, names: Any) -> None:
        for nm in names:
            c = self._storing.get(nm, 0)
            if c <= 1:
                self._storing.pop(nm, None)
            else:
                self._storing[nm] = c - 1

    def _tell(self, fn: Callable[..., None], *args: Any) -> None:
        """Call a listener; its failure is logged, never lost work or a missing signal."""
        try:
            fn(*args)
        except Exception:
            log.exception("L2 listener %s failed", getattr(fn, "__name__", fn))

    # ---- lookup and lock ----------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: Sequence[ObjectKey], layout: Any | None = None) -> L2TaskId:
        keys = list(keys)
        try:
            cands: list[tuple[str, ...]] | None = [self._names(k) for k in keys]
        except InvalidKeyError:
            cands = None  # the task reports it (as misses) from the loop
        accessed: list[ObjectKey] = []
        with self._lock:
            tid = self._new_id()
            if self._full_fixed is None:
                if isinstance(layout, int) and layout > 0:
                    layout = {0: layout}
                if isinstance(layout, dict):
                    self._full.update({int(g): int(b) for g, b in layout.items() if int(b) > 0})
            if self._closed:
                done: list[bool] | None = [False] * len(keys)
            elif cands is not None and self._all_known(cands):
                # Every key is answered by the index (or a fresh remembered miss): no I/O is
                # needed, so answer now instead of paying a hop through the loop thread.
                done = self._lock_hits(keys, cands, accessed)
            else:
                done = None
                self._schedule(self._run_lookup(tid, keys))
        if done is not None:
            self._stats["lookups"] += 1
            self._finish_lookup(tid, done, accessed)
        return tid

    def _finish_lookup(self, tid: L2TaskId, hits: list[bool], accessed: list[ObjectKey]) -> None:
        """Publish the result and signal, then tell the listener of the hits: LMCache's hfbucket
        and s3 adapters call ``_notify_keys_accessed`` right after the lookup signal, which keeps
        LMCache's listeners and event bus off the lookup's latency."""
        with self._lock:
            self._lookup_done[tid] = hits
        self._lookup_efd.notify()
        if accessed and self.listener is not None:
            self._tell(self.listener.on_keys_accessed, accessed)

    def _all_known(self, cands: list[tuple[str, ...]]) -> bool:
        """Whether every key is in the index or a remembered miss under every name (call with ``_lock``)."""
        if self._fleet is not None and self._rebuilt:
            return True  # the fleet's journals tell every store within sync_secs: no HEADs
        now = time.monotonic()
        index, missing = self._index, self._missing
        return all(
            any(n in index for n in c) or all(missing.get(n, 0.0) > now for n in c) for c in cands
        )

    def _lock_hits(
        self, keys: list[ObjectKey], cands: list[tuple[str, ...]], accessed: list[ObjectKey]
    ) -> list[bool]:
        """Hits among indexed names; lock and touch each (call with ``_lock``)."""
        hits = [False] * len(keys)
        hit_names: list[str] = []
        for i, c in enumerate(cands):
            name = self._where(c)
            if name is None:
                continue
            entry = self._index.get(name)
            if entry is None or name in self._deleting or not self._usable(keys[i], entry.size):
                continue
            hits[i] = True
            self._locks[name] = self._locks.get(name, 0) + 1
            self._index.touch(name)
            accessed.append(keys[i])
            hit_names.append(name)
        if self._fleet is not None and hit_names:
            self._fleet.accessed(hit_names)
        return hits

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> list[bool] | None:
        with self._lock:
            return self._lookup_done.pop(task_id, None)

    def submit_unlock(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                try:
                    cands = self._names(key)
                except InvalidKeyError:
                    continue
                name = next((n for n in cands if self._locks.get(n)), None)
                if name is None:
                    continue
                count = self._locks[name]
                if count <= 1:
                    self._locks.pop(name, None)
                else:
                    self._locks[name] = count - 1

    async def _run_lookup(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        n = len(keys)
        hits = [False] * n
        accessed: list[ObjectKey] = []
        try:
            cands = [self._names(k) for k in keys]
            found: list[ObjectKey] = []
            found_sizes: list[int] = []
            # Every name format in one round (one head_many): a key not found under kvbucket's
            # name is found under LMCache's, so a bucket LMCache filled is read without any
            # setting, at the latency of one round.
            now = time.monotonic()
            ask: list[tuple[int, str]] = []
            with self._lock:
                for i, c in enumerate(cands):
                    if self._where(c) is not None:
                        continue
                    ask.extend((i, nm) for nm in c if self._missing.get(nm, 0.0) <= now)
            if ask:
                heads = await self._sliced(self._store.head_many, [nm for _, nm in ask])
                expiry = time.monotonic() + self._neg_ttl
                with self._lock:
                    for (i, name), h in zip(ask, heads, strict=True):
                        if h.found and h.size:
                            if name not in self._index and name not in self._deleting:
                                self._index.add(name, keys[i], h.size)
                                found.append(keys[i])
                                found_sizes.append(h.size)
                        elif h.ok and self._neg_ttl > 0:
                            self._missing[name] = expiry
            if found and self.listener is not None:
                self._tell(self.listener.on_keys_stored, found, found_sizes)
            with self._lock:
                hits = self._lock_hits(keys, cands, accessed)
        except Exception as e:
            log.exception("lookup task %d failed", tid)
            self._last_error = f"{type(e).__name__}: {e}"
        self._stats["lookups"] += 1
        self._finish_lookup(tid, hits, accessed)

    # ---- load -------------------------------------------------------------------------------------
    def submit_load_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        keys, buffers = list(keys), list(buffers)
        with self._lock:
            tid = self._new_id()
            if self._closed or len(keys) != len(buffers):
                self._load_done[tid] = [False] * len(keys)
            else:
                self._schedule(self._run_load(tid, keys, buffers, keepalive))
                return tid
        self._load_efd.notify()
        return tid

    def query_load_result(self, task_id: L2TaskId) -> list[bool] | None:
        with self._lock:
            return self._load_done.pop(task_id, None)

    async def _run_load(
        self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Buffer], keepalive: Any = None
    ) -> None:
        n = len(keys)
        ok = [False] * n
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        try:
            cands = [self._names(k) for k in keys]
            with self._lock:
                # The name the index knows first, then the others in order.
                order = [_known_first(c, self._where(c)) for c in cands]
            todo = list(range(n))
            r = 0
            while todo:
                results = await self._sliced(
                    self._store.get_many, [order[i][r] for i in todo], [buffers[i] for i in todo]
                )
                retry: list[int] = []
                with self._lock:
                    for i, res in zip(todo, results, strict=True):
                        name = order[i][r]
                        if res.found:
                            ok[i] = True
                            self._index.touch(name)
                        elif isinstance(res.error, SizeMismatchError):
                            self._stats["size_mismatches"] += 1
                            _repeated.warning(
                                "load task %d: %s; reported as a miss", tid, res.error, item=tid
                            )
                        elif res.ok:  # not there (deleted elsewhere): forget it, try the next name
                            size = self._index.remove(name)
                            if size:
                                gone_keys.append(keys[i])
                                gone_sizes.append(size)
                                if self._fleet is not None:
                                    self._fleet.deleted([name])
                            if r + 1 < len(order[i]):
                                retry.append(i)
                        else:
                            self._last_error = str(res.error)
                todo, r = retry, r + 1
        except Exception as e:
            log.exception("load task %d failed", tid)
            self._last_error = f"{type(e).__name__}: {e}"
        self._stats["loads"] += 1
        self._stats["load_misses"] += ok.count(False)
        if gone_keys and self.listener is not None:
            self._tell(self.listener.on_keys_deleted, gone_keys, gone_sizes)
        with self._lock:
            self._load_done[tid] = ok
        self._load_efd.notify()

    # ---- delete and eviction -------------------------------------------------------------------------
    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Remove each key under every name it may have. As LMCache's hfbucket and s3 adapters
        do, every removed key is reported to the listener, a key that was not stored included
        (with size 0); locked keys are skipped and not reported."""
        keys = list(keys)
        cands = [self._names(k) for k in keys]
        with self._lock:
            if self._closed:
                return [False] * len(keys)
            take = [
                i
                for i, c in enumerate(cands)
                if not any(self._locks.get(nm) or nm in self._deleting for nm in c)
            ]
            for i in take:
                self._deleting.update(cands[i])
        if threading.current_thread() is self._thread:
            raise RuntimeError("delete() must not be called from the adapter's own loop thread")
        flat = [nm for i in take for nm in cands[i]]
        fut = asyncio.run_coroutine_threadsafe(self._delete_names(flat, notify=False), self._loop)
        gone, sizes = fut.result(timeout=self._delete_timeout)
        removed = dict(zip(flat, gone, strict=True))
        out = [False] * len(keys)
        for i in take:
            out[i] = all(removed[nm] for nm in cands[i])
        told = [i for i in take if out[i]]
        if told and self.listener is not None:
            self._tell(
                self.listener.on_keys_deleted,
                [keys[i] for i in told],
                [sum(sizes.get(nm, 0) for nm in cands[i]) for i in told],
            )
        self._stats["deleted_keys"] += sum(out)
        return out

    async def _delete_names(
        self, names: list[str], *, notify: bool = True, evicted: bool = False
    ) -> tuple[list[bool], dict[str, int]]:
        """Delete from the store, then from the index; names must be in ``_deleting``.

        Returns which names are gone and the indexed size of each removed indexed name; with
        ``notify`` the listener is told of the removed indexed keys."""
        try:
            results = await self._sliced(self._store.delete_many, names)
        except Exception as e:
            results = [ItemResult(n, error=StoreError(str(e))) for n in names]
        removed = [r.ok for r in results]
        gone_keys: list[ObjectKey] = []
        gone_sizes: list[int] = []
        sizes: dict[str, int] = {}
        with self._lock:
            for name, r in zip(names, results, strict=True):
                self._deleting.discard(name)
                if not r.ok:
                    self._stats["delete_failures"] += 1
                    self._last_error = str(r.error)
                    continue
                if not self._rebuilt:
                    self._deleted_while_rebuilding.add(name)
                if self._fleet is not None:
                    self._fleet.deleted([name], evicted=evicted)
                entry = self._index.get(name)
                size = self._index.remove(name)
                if entry is not None:
                    sizes[name] = size
                    gone_keys.append(entry.key)
                    gone_sizes.append(size)
        if notify and gone_keys and self.listener is not None:
            self._tell(self.listener.on_keys_deleted, gone_keys, gone_sizes)
        return removed, sizes

    def _maybe_evict(self) -> None:
        """Called on the loop thread after a store: start one eviction pass if needed."""
        cfg = self._eviction
        if cfg is None or self._evicting or self._closed:
            return
        with self._lock:
            expired = self._fleet is not None and self._fleet.has_expired()
            if not expired and not cfg.triggered(self._index.bytes_used, self._capacity):
                return
            self._evicting = True
        self._loop.create_task(self._evict())

    async def _evict(self) -> None:
        assert self._eviction is not None
        try:
            while not self._closed:
                with self._lock:
                    busy = set(self._locks) | self._deleting
                    if self._fleet is not None:
                        victims = self._fleet.victims(busy)
                    else:
                        victims = choose_victims(self._index, self._capacity, self._eviction, busy)
                    sizes = {v: e.size for v in victims if (e := self._index.get(v)) is not None}
                    self._deleting.update(victims)
                if not victims:
                    return
                removed, _ = await self._delete_names(victims, evicted=True)
                self._stats["evicted_keys"] += sum(removed)
                self._stats["evicted_bytes"] += sum(
                    sizes.get(v, 0) for v, r in zip(victims, removed, strict=True) if r
                )
                if not any(removed) or self._fleet is not None:
                    # The store refuses deletes (try again after the next store), or a fleet
                    # node took its share of this round (the next sync round shows the rest).
                    return
        finally:
            self._evicting = False

    # ---- usage, listing, status ------------------------------------------------------------------------
    def get_usage(self) -> Usage:
        with self._lock:
            return Usage(
                bytes_used=self._index.bytes_used,
                capacity_bytes=self._capacity,
                bytes_by_cache_salt=MappingProxyType(self._index.bytes_by_salt()),
                complete=self._rebuilt,
            )

    def wait_until_rebuilt(self, timeout: float | None = None) -> bool:
        """Block until the startup listing has been read (for tools and tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._rebuilt:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    async def _rebuild(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._rebuild_sync)
        except Exception as e:
            log.exception(
                "could not list %s to rebuild usage; usage counts only this run's stores", self._store.url
            )
            self._last_error = f"usage rebuild failed: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._rebuilt = True
                self._deleted_while_rebuilding.clear()

    def _rebuild_sync(self) -> None:
        prefix = f"{self._prefix}/" if self._prefix else ""
        page: list[tuple[str, ObjectKey, int, float]] = []

        def flush() -> None:
            # Newest first with touch=False, so the oldest ends up at the LRU end.
            page.sort(key=lambda t: t[3], reverse=True)
            with self._lock:
                for name, key, size, _ in page:
                    if (
                        name not in self._deleted_while_rebuilding
                        and name not in self._deleting
                        and name not in self._storing
                    ):
                        self._index.add(name, key, size, touch=False)
            page.clear()

        for info in self._store.list(prefix):
            if self._closed:
                return
            key = self._naming.parse(info.name)  # kvbucket's names and LMCache's
            if key is None:
                if not is_fleet_name(info.name, self._prefix):
                    self._stats["foreign_objects"] += 1
                continue
            page.append((info.name, key, info.size, info.mtime or 0.0))
            if len(page) >= _REBUILD_PAGE:
                flush()
        flush()

    def list_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyPage:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if cursor is not None and (not isinstance(cursor, str) or not cursor):
            raise ValueError("cursor must be the non-empty string returned as next_cursor")
        start = f"{self._prefix}/" if self._prefix else ""
        if self._rebuilt:
            with self._lock:
                names = sorted(
                    (n, e.key, e.size)
                    for n in self._index.names()
                    if (e := self._index.get(n)) is not None
                    and (not model_name or e.key.model_name == model_name)
                )
        else:
            names = []
            for info in self._store.list(start):
                key = self._naming.parse(info.name)
                if key is None or (model_name and key.model_name != model_name):
                    continue
                names.append((info.name, key, info.size))
            names.sort()
        pos = bisect_right([n for n, _, _ in names], cursor) if cursor else 0
        chunk = names[pos : pos + page_size]
        more = pos + page_size < len(names)
        return KeyPage(tuple((k, s) for _, k, s in chunk), chunk[-1][0] if more and chunk else None)

    def report_status(self) -> dict[str, Any]:
        usage = self.get_usage()
        with self._lock:
            locked = sum(1 for c in self._locks.values() if c > 0)
            keys = len(self._index)
        return {
            "is_healthy": not self._closed,
            "store": self._store.url,
            "prefix": self._prefix,
            "keys": keys,
            "bytes_used": usage.bytes_used,
            "capacity_bytes": usage.capacity_bytes,
            "usage_fraction": usage.usage_fraction,
            "usage_complete": usage.complete,
            "locked_keys": locked,
            "inflight_tasks": len(self._inflight),
            "full_chunk_bytes": self._full_fixed if self._full_fixed is not None else dict(self._full),
            "eviction_policy": self._eviction.eviction_policy if self._eviction else None,
            "last_error": self._last_error,
            **self._stats,
            **({"fleet": self._fleet.status()} if self._fleet is not None else {}),
        }

    # ---- close --------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._inflight)
        # Let submitted work finish (callers' buffers may be read or written until then), within
        # one overall deadline.
        deadline = time.monotonic() + self._delete_timeout
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
        if self._fleet is not None:
            self._fleet.close()  # publishes what it still buffers
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        flush_all()  # the counts of repeated failures
        if not self._thread.is_alive():
            self._loop.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        if self._owns_store:
            self._store.close()
        if self._work_dir is not None:  # LMCache removes its session dir on close
            shutil.rmtree(self._work_dir, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"ObjectStoreL2Adapter({self._store.url!r}, prefix={self._prefix!r})"


def _known_first(cands: tuple[str, ...], known: str | None) -> tuple[str, ...]:
    if known is None or known == cands[0]:
        return cands
    return (known, *(c for c in cands if c != known))


def _item_name(x: Any) -> str:
    return x[0] if isinstance(x, tuple) else str(x)


__all__ = ["L2Listener", "ObjectStoreL2Adapter"]
