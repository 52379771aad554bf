"""One L2 adapter implementation over any :class:`~kvbucket.stores.base.ObjectStore`.

:class:`ObjectStoreL2Adapter` is assembled from parts that each own their state and are handed
the parts they use:

- :class:`~kvbucket.l2.state.KeyState`: what the adapter knows about the store's keys (the
  index, key locks, deletes and stores in progress, remembered misses), and the one lock that
  guards it;
- :class:`~kvbucket.l2.tasks.TaskRunner`: the loop thread and the store-call pool;
  :class:`~kvbucket.l2.tasks.Completions`: one table of finished results and one event fd per path;
- :class:`~kvbucket.l2.context.AdapterContext`: the shared parts above (with the store, the
  counters, the listener and the fleet), built once and handed to every path;
- :mod:`kvbucket.l2.store_path`: store tasks (any sizes, mixed, unless ``full_chunk_bytes``);
- :mod:`kvbucket.l2.lookup_path`: lookup-and-lock, answered from the index when it can;
- :mod:`kvbucket.l2.load_path`: loads (exact sizes only; a gone object heals the index);
- :mod:`kvbucket.l2.removal`: delete and eviction;
- :mod:`kvbucket.l2.inventory`: usage, the startup rebuild, listing, status.

What it knows about the store lives in a :class:`~kvbucket.l2.accounting.KeyIndex` rebuilt
from the store's listing at start (in the background) and kept exact afterwards.

Names: :class:`~kvbucket.l2.naming.Naming` gives the name a key is written under and the
names it is read under (kvbucket's, then LMCache's built-in adapter's for the same store), so
a bucket LMCache filled is read as is.

Listener events: stored and deleted keys are told before the task's completion is signalled
(as LMCache's adapters do for stores); accessed keys (a lookup hit) right after the lookup's
signal, as LMCache's hfbucket and s3 adapters do.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbucket.keys import ObjectKey
from kvbucket.l2.base import KeyPage, L2Adapter, L2TaskId, StoreResult, Usage
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import L2Listener, Listeners, NameCache, Stats
from kvbucket.l2.eviction import EvictionConfig, effective_eviction
from kvbucket.l2.format_store import route_formats
from kvbucket.l2.inventory import InventoryPath
from kvbucket.l2.load_path import LoadPath
from kvbucket.l2.lookup_path import LookupPath
from kvbucket.l2.naming import Naming, watch_identities
from kvbucket.l2.removal import RemovalPath
from kvbucket.l2.state import KeyState
from kvbucket.l2.store_path import StorePath
from kvbucket.l2.tasks import TaskRunner
from kvbucket.log_once import flush_all
from kvbucket.stores.base import Buffer, ObjectStore, check_prefix
from kvbucket.stores.guard.breaker import breaker_of
from kvbucket.stores.guard.read_ahead import PrefetchStore, with_read_ahead
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.threads import in_daemon_thread

if TYPE_CHECKING:
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.fleet.host import FleetLink
    from kvbucket.fleet.view import Change

#: What close() may take past its deadline (delete_timeout_secs) to stop its threads.
CLOSE_MARGIN_SECS = 0.5


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
        read_ahead: ReadAheadSettings | None = None,
    ) -> None:
        """``fleet``: share capacity, eviction and visibility with every other node on this
        prefix through the store (see :mod:`kvbucket.fleet`); usage is then rebuilt from the
        fleet's snapshot and journals instead of a listing. ``read_ahead``: a lookup hit starts
        its load (:mod:`kvbucket.stores.guard.read_ahead`; None: off)."""
        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        self._prefix = check_prefix(prefix)
        self._naming = naming if naming is not None else Naming(self._prefix)
        if self._naming.prefix != self._prefix:
            raise ValueError("naming and adapter prefixes differ")
        capacity = int(max_capacity_bytes)
        eviction = effective_eviction(eviction, capacity, fleet=fleet is not None)  # may refuse: first
        # Every write under kvbucket's names goes through SealedStore.put_many (one function:
        # SealedStore.seal) and every such load is verified there; refused objects come back as
        # misses (then forgotten). LMCache's names hold LMCache's raw bytes (kvbucket.l2.format_store).
        self._store = route_formats(
            seal_store(store, tier="l2", unsealed=unsealed, encryption=encryption), self._naming
        )
        # Every path goes through the read-ahead buffer (when on): lookups start loads, loads take
        # them, and stores and deletes drop what they replace or remove. Its series are labelled
        # with the store's URL, as the store's own are (one lmcache server may run several adapters).
        self._io = with_read_ahead(self._store, read_ahead, label=self._store.url)
        # A per-process working dir (LMCache's download session dir), removed on close.
        self._work_dir = work_dir
        self._owns_store = owns_store
        self._delete_timeout = delete_timeout_secs

        self._state = KeyState(full_chunk_bytes=full_chunk_bytes, rebuilt=not rebuild_usage and fleet is None)
        self._stats = Stats()
        self._listeners = Listeners(listener)
        self._names = NameCache(self._naming)
        watch_identities(self._naming, store, "kvbucket L2 adapter", "adapter_params.model_identity",
                         "adapter_params.accept_name_only")
        self._runner = TaskRunner(num_workers, split_batches=split_batches, stats=self._stats)
        self._fleet: FleetLink | None = None
        if fleet is not None:
            from kvbucket.fleet.host import FleetLink

            self._fleet = FleetLink(
                self._store,  # it writes its own objects to the store under the sealing layer
                fleet,
                parse=self._naming.parse,
                prefix=self._prefix,
                capacity=capacity,
                eviction=eviction,
                on_changes=self._apply_fleet_changes,
                on_tick=self._fleet_tick,
                on_ready=self._fleet_ready,
            )
        ctx = AdapterContext(
            self._state, self._names, self._runner, self._io, self._stats, self._listeners, self._fleet
        )
        self._removal = RemovalPath(
            ctx, eviction=eviction, capacity=capacity, delete_timeout=delete_timeout_secs
        )
        self._stores = StorePath(ctx, after_store=self._removal.maybe_evict)
        self._lookups = LookupPath(
            ctx, breaker=breaker_of(self._store), negative_ttl=float(metadata_cache_ttl_secs)
        )
        self._loads = LoadPath(ctx, refused_ttl=float(metadata_cache_ttl_secs))
        self._inventory = InventoryPath(ctx, capacity=capacity, eviction=eviction)
        if capacity > 0:  # capacity, usage and eviction series, fleet or not (kvbucket.l2.gauges)
            from kvbucket.l2 import gauges

            gauges.track(self, self._store.url, capacity)
        if self._fleet is not None:
            self._fleet.start()
        elif rebuild_usage:
            self._runner.schedule(self._rebuild())

    async def _rebuild(self) -> None:
        """Rebuild usage from a listing, then evict if it is over the watermark: a bucket another
        process left over its capacity (its close ran out of time) shrinks now, not at the first store."""
        await self._inventory.rebuild()
        self._removal.maybe_evict()

    # ---- small helpers ------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        return self._store

    @property
    def read_ahead_store(self) -> PrefetchStore | None:
        """The read-ahead buffer lookups fill and loads take from (None: read-ahead is off)."""
        return self._io if isinstance(self._io, PrefetchStore) else None

    @property
    def naming(self) -> Naming:
        return self._naming

    @property
    def listener(self) -> L2Listener | None:
        return self._listeners.listener

    @listener.setter
    def listener(self, listener: L2Listener | None) -> None:
        self._listeners.listener = listener

    @property
    def _evicting(self) -> bool:
        """An eviction pass is running (tests wait for it to end)."""
        return self._removal.evicting

    # ---- event fds --------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._stores.done.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.done.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.done.fileno()

    # ---- the paths ----------------------------------------------------------------------------
    def submit_store_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        """``keepalive``: objects owning the buffers' memory, held until the task completes (a
        ctypes view of an LMCache MemoryObj does not keep the MemoryObj alive)."""
        return self._stores.submit(keys, buffers, keepalive=keepalive)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, StoreResult]:
        return self._stores.done.pop_all()

    def submit_lookup_and_lock_task(self, keys: Sequence[ObjectKey], layout: Any | None = None) -> L2TaskId:
        return self._lookups.submit(keys, layout)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> list[bool] | None:
        return self._lookups.done.pop(task_id)

    def submit_unlock(self, keys: Sequence[ObjectKey]) -> None:
        self._lookups.unlock(keys)

    def submit_load_task(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], *, keepalive: Any = None
    ) -> L2TaskId:
        return self._loads.submit(keys, buffers, keepalive=keepalive)

    def query_load_result(self, task_id: L2TaskId) -> list[bool] | None:
        return self._loads.done.pop(task_id)

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self._removal.delete(keys)

    def get_usage(self) -> Usage:
        return self._inventory.get_usage()

    def wait_until_rebuilt(self, timeout: float | None = None) -> bool:
        """Block until the startup listing has been read (for tools and tests)."""
        return self._inventory.wait_until_rebuilt(timeout)

    def list_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyPage:
        return self._inventory.list_keys(model_name, page_size, cursor)

    def report_status(self) -> dict[str, Any]:
        return self._inventory.report_status()

    def stats(self) -> dict[str, int]:
        """The adapter's counters (stores, evicted keys and bytes, ...), as a copy."""
        return {k: v for k, v in self._stats.items() if isinstance(v, int)}

    # ---- the fleet's callbacks (from its thread) -------------------------------------------------
    def _apply_fleet_changes(self, changes: list[Change]) -> None:
        """Mirror what other nodes stored and deleted into the index, then tell the listener."""
        # Imported here, as FleetLink is: kvbucket.fleet's modules import kvbucket.l2.eviction,
        # whose package __init__ imports this module.
        from kvbucket.fleet.view import key_of

        st = self._state
        added: list[tuple[ObjectKey, int]] = []
        gone: list[tuple[ObjectKey, int]] = []
        if isinstance(self._io, PrefetchStore):  # rewritten or deleted by another node
            self._io.forget([name for name, _ in changes])
        with st.lock:
            for name, size in changes:
                if name in st.deleting:
                    continue
                if size is None:
                    entry = st.index.get(name)
                    if entry is not None and st.index.remove(name):
                        gone.append((entry.key, entry.size))
                    continue
                key = key_of(name, self._prefix) or self._naming.parse(name)
                if key is not None and self._naming.identity:  # another identity's chunk: not ours
                    key = self._naming.own_key(key)
                if key is None:
                    continue
                was_new = name not in st.index
                st.index.add(name, key, size, touch=False)
                st.missing.pop(name, None)
                if st.full_fixed is None:
                    group = key.kv_rank >> 32
                    st.full[group] = max(st.full.get(group, 0), size)
                if was_new:
                    added.append((key, size))
        listener = self.listener
        if listener is not None:
            if added:
                listener.on_keys_stored([k for k, _ in added], [s for _, s in added])
            if gone:
                listener.on_keys_deleted([k for k, _ in gone], [s for _, s in gone])

    def _fleet_tick(self) -> None:
        if not self._state.closed:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._runner.call_soon(self._removal.maybe_evict)

    def _fleet_ready(self) -> None:
        with self._state.lock:
            self._state.rebuilt = True

    # ---- close --------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._state.lock:
            if self._state.closed:
                return
            self._state.closed = True
            pending = list(self._runner.inflight)
        # Let submitted work finish (callers' buffers may be read or written until then), within
        # one overall deadline.
        deadline = time.monotonic() + self._delete_timeout
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
        # The stores that landed meanwhile may have passed the watermark: evict, within the same deadline.
        self._removal.evict_on_close(deadline)
        if self._fleet is not None:
            self._fleet.close()  # publishes what it still buffers
        # The rest ends by the deadline plus a small margin: a store call stuck past it (a hung
        # delete) is left on its daemon thread rather than holding close() up.
        until = max(deadline, time.monotonic()) + CLOSE_MARGIN_SECS
        self._runner.stop(until)
        flush_all()  # the counts of repeated failures
        for done in (self._stores.done, self._lookups.done, self._loads.done):
            done.close()
        if isinstance(self._io, PrefetchStore):
            self._io.stop()
        if self._owns_store:
            closing = in_daemon_thread(self._store.close, "kvbucket-l2-close")
            with contextlib.suppress(Exception):  # its failure or its time: the store is dropped
                closing.result(timeout=max(0.0, until - time.monotonic()))
        if self._work_dir is not None:  # LMCache removes its session dir on close
            shutil.rmtree(self._work_dir, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        return f"ObjectStoreL2Adapter({self._store.url!r}, prefix={self._prefix!r})"


__all__ = ["L2Listener", "ObjectStoreL2Adapter"]
