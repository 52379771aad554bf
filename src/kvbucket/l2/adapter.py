"""One L2 adapter implementation over any :class:`~kvbucket.stores.base.ObjectStore`.

:class:`ObjectStoreL2Adapter` is assembled from one mixin per path over shared state
(:mod:`kvbucket.l2.core`: threads, names, batch slicing):

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

import asyncio
import contextlib
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from kvbucket.l2.accounting import KeyIndex
from kvbucket.l2.base import EventNotifier
from kvbucket.l2.core import L2Listener
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.l2.format_store import route_formats
from kvbucket.l2.inventory import InventoryPath
from kvbucket.l2.load_path import LoadPath
from kvbucket.l2.lookup_path import LookupPath
from kvbucket.l2.naming import Naming
from kvbucket.l2.removal import RemovalPath
from kvbucket.l2.store_path import StorePath
from kvbucket.log_once import flush_all
from kvbucket.stores.base import ObjectStore, check_prefix
from kvbucket.stores.breaker import breaker_of
from kvbucket.stores.sealed import seal_store
from kvbucket.threads import DaemonThreadPool

if TYPE_CHECKING:
    from kvbucket.fleet.config import FleetConfig


class ObjectStoreL2Adapter(StorePath, LookupPath, LoadPath, RemovalPath, InventoryPath):
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
        # While the store's breaker is open, lookups answer from the index alone, at once.
        self._breaker = breaker_of(self._store)
        # A per-process working dir (LMCache's download session dir), removed on close.
        self._work_dir = work_dir
        self._num_workers = num_workers
        self._capacity = int(max_capacity_bytes)
        self._eviction = eviction
        self._neg_ttl = float(metadata_cache_ttl_secs)
        # Full chunk size per object group (``kv_rank >> 32``, see kvbucket.integrations.lmcache).
        self._full_fixed = full_chunk_bytes
        self._full = {}
        self._owns_store = owns_store
        self._delete_timeout = delete_timeout_secs
        # Stores that run a batch's items concurrently themselves (S3, HF buckets) get whole
        # batches; others (a directory) get one slice per worker.
        self._split = split_batches
        self.listener = listener

        self._lock = threading.Lock()
        self._name_cache = {}
        self._index = KeyIndex()
        self._locks = {}
        self._deleting = set()
        # Names a store task is writing: the startup listing leaves them to the task, which
        # reports them to the listener as stored.
        self._storing = {}
        self._missing = {}  # name -> monotonic expiry of a remembered miss
        self._next_id = 0
        self._store_done = {}
        self._lookup_done = {}
        self._load_done = {}
        self._inflight = set()
        self._closed = False
        self._evicting = False
        self._rebuilt = not rebuild_usage and fleet is None
        self._deleted_while_rebuilding = set()
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
            "breaker_misses": 0,  # keys a lookup answered as misses, unasked, while the breaker was open
        }
        self._last_error = None

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

    # ---- event fds --------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

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


__all__ = ["L2Listener", "ObjectStoreL2Adapter"]
