"""RemoteBackend and PipelinedRemoteBackend: chunk tiers over any :class:`ObjectStore`.

The seeds' full-chunk rules (001, 004) are enforced here, once, for every store:

- with ``save_unfull_chunk=False`` a chunk whose size is not ``layout.full_chunk_bytes`` is
  refused on put with :class:`ChunkSizeError` (never silently skipped; ``batched_put`` counts only
  what landed and ``batched_put_results`` says why each item failed);
- a stored object whose size is not the full-chunk size is refused on read: it is a miss,
  logged once per object, and its bytes are never returned (reads go into a buffer of exactly
  the full size, so a wrong-sized object cannot even be copied);
- ``contains`` means "exists with the full size".

Every blocking call to the store is bounded by ``blocking_timeout_secs`` (and by the store's own
deadlines, usually shorter). A lookup or read the store cannot answer (hung, down, its circuit
breaker open) is a miss, counted in ``lookup_failures``/``read_failures`` and logged once per
kind, never an exception: the engine recomputes. With the breaker open, lookups and reads answer
at once without touching the store. A put past the timeout gets a :class:`TransientStoreError`
naming it, and nothing of that call is counted. A read into caller buffers that waited too long
for an io thread is not started (:mod:`kvbucket.backends.late_start`).

With a fleet (``fleet`` settings, :mod:`kvbucket.backends.fleet`) the tier shares one capacity
with every other node on its prefix: a store past the fleet's write cap fails for that chunk
(:class:`~kvbucket.backends.fleet.FleetWriteCapError`, never counted), stores, loads and removes
are noted to the fleet, the tier deletes its share of the fleet-wide victims after each round,
and chunks deleted anywhere in the fleet leave the size cache (so ``contains`` does not answer
them from memory). ``close()`` publishes the tier's last journal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvbucket.backends._putqueue import DEFAULT_FULL_WAIT_SECS, PutQueue
from kvbucket.backends._queued import QueuedBackend
from kvbucket.backends.base import Chunk, Key, check_buffers, check_open, put_as_batch
from kvbucket.backends.fleet import REFUSED, FleetWriteCapError, open_tier_fleet
from kvbucket.backends.late_start import LateStart, closed_error, submit_open
from kvbucket.backends.tier_identity import TierIdentity
from kvbucket.chunks import ChunkSizeError, KVLayout, as_view, get_serde
from kvbucket.errors import (
    CircuitOpenError,
    InvalidKeyError,
    SizeMismatchError,
    StoreError,
    TransientStoreError,
)
from kvbucket.identity.core import ModelIdentity, split_key_string
from kvbucket.keys import as_key_string, key_to_name, name_to_key
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import ItemResult, ObjectStore, check_prefix
from kvbucket.stores.guard.breaker import breaker_of
from kvbucket.stores.guard.read_ahead import PrefetchStore, read_ahead, with_read_ahead
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.threads import DaemonThreadPool

if TYPE_CHECKING:
    from kvbucket.integrations.engine_fleet import FleetSettings

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count
T = TypeVar("T")


def layout_identity(layout: KVLayout) -> str:
    """What a chunk's envelope records of the KV layout it was written for."""
    return (f"kv:{layout.num_layers}x{layout.kv_factor}x{layout.chunk_tokens}x{layout.num_kv_heads}x"
            f"{layout.head_size}:{layout.dtype}")


class RemoteBackend(QueuedBackend):
    """A chunk tier over an object store (FileStore, MemoryStore, S3, HF buckets, ...).

    Keys become object names with :func:`kvbucket.keys.key_to_name` under ``prefix``, so
    ``list()`` answers with key strings. Batched verbs use the store's batch verbs (one
    ``put_many``/``get_many`` call per batch). Non-blocking puts go through a bounded queue and
    one worker thread, like LMCache's ``put_worker``.
    """

    def __init__(
        self,
        store: ObjectStore,
        layout: KVLayout,
        *,
        serde: str = "naive",
        save_unfull_chunk: bool = False,
        blocking_timeout_secs: float | None = 10.0,
        prefix: str = "",
        exists_cache_ttl_secs: float = 30.0,
        exists_cache_max: int = 65536,
        io_threads: int = 4,
        queue_size: int = 64,
        queue_full_wait_secs: float | None = DEFAULT_FULL_WAIT_SECS,
        owns_store: bool = True,
        unsealed: str = "miss",
        encryption: Any = None,
        fleet: FleetSettings | None = None,
        read_ahead: ReadAheadSettings | None = None,
        model_identity: str | dict[str, str] | None = None,
    ) -> None:
        # Names carry the model's identity (kvbucket.identity): chunks of another identity are
        # other objects, a miss; without one they are shared by model name only, as before.
        # Each identity's manifest goes under the prefix (kvbucket.identity.manifest), in the raw store.
        self._identity = TierIdentity(model_identity, store, check_prefix(prefix), "kvbucket remote tier")
        # Every object is sealed on write and verified on read (kvbucket.stores.guard.sealed); the
        # envelope names the KV layout, so a chunk written for another layout is a miss. A
        # lookup hit starts its load behind that check (kvbucket.stores.guard.read_ahead).
        self.store = seal_store(store, tier="remote", identity=layout_identity(layout), unsealed=unsealed,
                                encryption=encryption)
        # Loads read through this (the sealed store itself, or a read-ahead buffer in front of it).
        # labelled with the store's URL, as its requests, circuit breaker and fleet series are
        self.reads = with_read_ahead(self.store, read_ahead, label=self.store.url)
        self.layout = layout
        self.serde = get_serde(serde)
        self.save_unfull_chunk = save_unfull_chunk
        self.blocking_timeout_secs = blocking_timeout_secs if blocking_timeout_secs else None
        self._late_start = LateStart(store, self.blocking_timeout_secs)
        self.prefix = check_prefix(prefix)
        self._owns_store = owns_store
        self._breaker = breaker_of(self.store)  # lookups and reads skip a store whose breaker is open
        self._exists: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._exists_ttl = exists_cache_ttl_secs
        self._exists_max = exists_cache_max
        self._exists_lock = threading.Lock()
        self._logged_bad: set[str] = set()
        self.lookup_failures = 0  # keys a lookup answered as a miss because the store failed
        self.read_failures = 0  # keys a read answered as a miss because the store call failed
        self._pool = DaemonThreadPool(io_threads, "kvbucket-remote")  # a stuck call never blocks exit
        # a full queue (slow or hung store) drops a non-blocking put after queue_full_wait_secs
        self._queue = PutQueue("remote", self._apply, queue_size, queue_full_wait_secs)
        self._closed = False
        # Last: its thread starts at once. It deletes victims through the sealed store and
        # keeps its own objects (_fleet/...) in the raw one, readable by `kvbucket du`.
        self._fleet = None if fleet is None else open_tier_fleet(
            fleet, store, self.store, self.prefix, self._invalidate)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r}, full_chunk_bytes={self.layout.full_chunk_bytes})"

    @property
    def full_chunk_bytes(self) -> int:
        return self.layout.full_chunk_bytes

    # ---- interface -----------------------------------------------------------------------
    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        put_as_batch(self, key, chunk, blocking)

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        check_open(self, self._closed)
        results: list[Exception | None] = []
        ready: list[tuple[int, str, memoryview]] = []
        for i, (key, chunk) in enumerate(items):
            try:
                k = as_key_string(key)
                self._name(k)  # a key that cannot be an object name fails here, for this item only
                view = as_view(chunk)
                self._check_put_size(k, view.nbytes)
            except Exception as e:
                results.append(e)
                continue
            results.append(None)
            ready.append((i, k, view))
        if not ready:
            return results
        if not blocking:
            for i, k, view in ready:
                try:
                    self._queue.submit(k, view)
                except Exception as e:
                    results[i] = e
            return results
        for _, k, _ in ready:
            self._queue.cancel(k)  # an older queued put of k must not land after this one
        errors = self._put_views([(k, v) for _, k, v in ready])
        for (i, _, _), err in zip(ready, errors, strict=True):
            results[i] = err
        return results

    def get(self, key: Key) -> Chunk | None:
        return self.batched_get([key])[0]

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        ks = [as_key_string(k) for k in keys]
        out, todo = self._read_pending(ks)
        if todo:
            fetched = self._fetch([ks[i] for i in todo])
            for i, r in zip(todo, fetched, strict=True):
                out[i] = self._decode(ks[i], r)
            self._loaded([ks[i] for i in todo if out[i] is not None])
        return out

    def batched_get_into(self, keys: Sequence[Key], buffers: Sequence[Chunk]) -> list[bool]:
        if self.serde.name != "naive":
            return super().batched_get_into(keys, buffers)
        check_buffers(keys, buffers)
        if self._identity.unknown(len(keys)):  # not known yet (IdentityPending): misses
            return [False] * len(keys)
        ks = [as_key_string(k) for k in keys]
        out, rest = self._copy_pending_into(ks, buffers)
        todo: list[int] = []
        for i in rest:
            if self._size_ok(as_view(buffers[i]).nbytes):
                todo.append(i)
            else:
                self._log_bad(ks[i], f"the caller's buffer is {as_view(buffers[i]).nbytes} bytes")
        if todo:
            names = [self._name(ks[i]) for i in todo]
            into = self._late_start.guard(self.reads.get_many)  # into caller buffers: started in time
            results = self._call_items(into, "get", names, [buffers[i] for i in todo])
            for i, r in zip(todo, results, strict=True):
                if r.error is not None:
                    if isinstance(r.error, SizeMismatchError):
                        self._log_bad(ks[i], str(r.error))
                    else:
                        self._read_failed(ks[i], r.error)
                if not r.found:  # missing, or refused by the integrity check (and removed)
                    self._invalidate([r.name])
                out[i] = r.found
            self._loaded([ks[i] for i in todo if out[i]])
        return out

    def contains(self, key: Key) -> bool:
        """Whether ``key`` is stored as a full chunk. A store that cannot answer (hung, down, its
        breaker open) answers a miss: the engine recomputes (counted in ``lookup_failures``)."""
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[Key]) -> list[bool]:
        """One ``head_many`` for every key not pending or cached (a lookup of 1,000 keys is one batch).

        A key the store could not answer for (deadline, breaker open, any store error) is a miss,
        counted in ``lookup_failures`` and logged once per kind of failure; never an exception.
        """
        if self._identity.unknown(len(keys)):  # not known yet (IdentityPending): misses
            return [False] * len(keys)
        ks = [as_key_string(k) for k in keys]
        out = [False] * len(ks)
        ask: list[int] = []
        hits: list[tuple[str, int]] = []  # (name, size) of stored hits: their loads start now
        for i, k in enumerate(ks):
            if self._queue.pending(k) is not None:
                out[i] = True
            elif (size := self._cached_size(name := self._name(k))) is not None:
                out[i] = True
                hits.append((name, size))
            else:
                ask.append(i)
        if ask:
            names = [self._name(ks[i]) for i in ask]
            results = self._call_items(self.store.head_many, "head", names)
            for i, r in zip(ask, results, strict=True):
                if r.error is not None:
                    self._lookup_failed(1, r.error)
                elif r.size is not None and self._size_ok(r.size):
                    self._cache_size(r.name, r.size)
                    out[i] = True
                    hits.append((r.name, r.size))
        if hits:
            read_ahead(self.reads, [n for n, _ in hits], [z for _, z in hits])
        return out

    def remove(self, key: Key) -> bool:
        k = as_key_string(key)
        dropped = self._queue.cancel(k)
        name = self._name(k)
        self._invalidate([name])
        (h,) = self._call(self.store.head_many, "head", [name])
        (r,) = self._call(self.store.delete_many, "delete", [name])
        self._invalidate([name])
        if r.error is not None:
            raise r.error
        if self._fleet is not None:
            self._fleet.deleted([name])
        return dropped or h.size is not None or r.size is not None

    def list(self) -> list[str]:
        if self._identity.unknown():
            return []
        keys: list[str] = []
        listing_prefix = f"{self.prefix}/" if self.prefix else ""
        for info in self.store.list(listing_prefix):
            if not self._size_ok(info.size):
                continue
            try:
                key, token = split_key_string(name_to_key(info.name, self.prefix))
            except InvalidKeyError:
                continue  # an object kvbucket did not write (or nested deeper): not a chunk
            if self._identity and token != self._identity.token(key.partition("@")[0]):
                continue  # another identity's chunk (or a name-only one) is not this tier's
            keys.append(name_to_key(info.name, self.prefix) if token and not self._identity else key)
        return self._with_pending(keys)

    def note_accessed(self, keys: Sequence[Key]) -> None:
        """A faster tier served these keys: the fleet's LRU hears of the use (no request)."""
        self._loaded([as_key_string(k) for k in keys])

    def report_status(self) -> dict[str, Any]:
        """The tier's counters and, in a fleet, the fleet's view (``["fleet"]``, as the L2 adapter's
        ``report_status()``): fleet-wide usage, per-salt bytes, nodes seen, evictions, refusals."""
        return {
            "tier": type(self).__name__,
            "store": self.store.url,
            "lookup_failures": self.lookup_failures,
            "read_failures": self.read_failures,
            "identity_pending": self._identity.pending_counts(),  # misses, stores dropped meanwhile
            "fleet": None if self._fleet is None else self._fleet.status(),
        }

    # ---- internals -----------------------------------------------------------------------
    def _loaded(self, keys: list[str]) -> None:
        if self._fleet is not None and keys:
            self._fleet.accessed([self._name(k) for k in keys])

    def _release(self) -> None:
        if self._fleet is not None:
            self._fleet.close()  # after the queue drained (QueuedBackend.close): its last journal
        self._identity.close()  # its manifest lands before the store closes
        self._pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.reads, PrefetchStore):  # the read-ahead buffer is this tier's own
            self.reads.stop()
        if self._owns_store:
            self.store.close()

    def note_identity(self, identity: ModelIdentity) -> None:
        """Keys its writer named ``<model>~<token>`` (transformers): a manifest with their first chunk."""
        self._identity.add(identity)

    def _name(self, key: str) -> str:
        return key_to_name(self._identity.key(key), self.prefix)

    def _size_ok(self, size: int) -> bool:
        return self.save_unfull_chunk or size == self.layout.full_chunk_bytes

    def _check_put_size(self, key: str, nbytes: int) -> None:
        full = self.layout.full_chunk_bytes
        if not self.save_unfull_chunk and nbytes != full:
            raise ChunkSizeError(
                f"chunk {key} is {nbytes} bytes but a full chunk is {full} bytes ({self.layout.describe()}); "
                "remote tiers refuse partial chunks while save_unfull_chunk is false. Store only full "
                "chunks, or check that the KV layout (layers, kv heads, head size, dtype, chunk_size) "
                "matches the model"
            )

    def _call(self, fn: Callable[..., T], what: str, *args: Any) -> T:
        """Run a blocking store call, bounded by ``blocking_timeout_secs`` (closed: a StoreError)."""
        return self._wait(submit_open(self._pool, f"{what} on {self.store.url}", fn, *args), what)

    def _call_items(self, fn: Callable[..., list[ItemResult]], what: str, names: list[str], *args: Any
                    ) -> list[ItemResult]:
        """A read-path batch call whose failure as a whole (``blocking_timeout_secs``) fails each
        item instead of raising: a read of a hung store is a miss, never an exception."""
        breaker = self._breaker
        if breaker is not None and breaker.refusing():  # at once: no thread hop, no store call
            return breaker.rejected(what, names)
        try:
            return self._call(fn, what, names, *args)
        except StoreError as e:
            return [ItemResult(n, error=e) for n in names]

    def _wait(self, fut: Future[T], what: str, deadline: float | None = None) -> T:
        """``fut``'s result within ``blocking_timeout_secs`` (or until ``deadline``, a monotonic
        instant: one bound for a call made of several store calls)."""
        timeout = self.blocking_timeout_secs if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return fut.result(timeout=timeout)
        except CancelledError:  # close() cancelled it while it waited for an io thread
            raise closed_error(f"{what} on {self.store.url}") from None
        except FutureTimeout:
            if self._breaker is not None:  # the store call runs on: its breaker learns of it now
                self._breaker.abandoned()
            raise TransientStoreError(
                f"{what} on {self.store.url} did not finish within blocking_timeout_secs="
                f"{self.blocking_timeout_secs:g}s; nothing of this call is counted. Check that the store "
                "is reachable, or raise blocking_timeout_secs (or io_threads, if calls wait for each other)"
            ) from None

    def _apply(self, key: str, view: memoryview) -> None:
        (err,) = self._put_views([(key, view)])
        if err is not None:
            raise err

    def _put_views(self, items: list[tuple[str, memoryview]]) -> list[Exception | None]:
        names = [self._name(k) for k, _ in items]
        payloads = [self.serde.serialize(v) for _, v in items]
        sizes = [memoryview(p).nbytes for p in payloads]
        kept = len(items) if self._fleet is None else self._fleet.admit(sizes)  # the fleet's write cap
        refused: list[Exception | None] = [
            FleetWriteCapError(f"{k}: {REFUSED}") for k, _ in items[kept:]]
        names, payloads, sizes = names[:kept], payloads[:kept], sizes[:kept]
        if not names:
            return refused
        self._invalidate(names)
        try:
            results = self._call(self.store.put_many, "put", list(zip(names, payloads, strict=True)))
        except StoreError as e:
            self._invalidate(names)
            return [e] * len(names) + refused
        if isinstance(self.reads, PrefetchStore):  # a lookup during the put may have read the old bytes ahead
            self.reads.forget(names)
        errors: list[Exception | None] = []
        landed: list[tuple[str, int]] = []
        for name, size, r in zip(names, sizes, results, strict=True):
            if r.error is not None:
                errors.append(r.error)
                continue
            self._cache_size(name, size)
            landed.append((name, size))
            errors.append(None)
        if self._fleet is not None and landed:  # only what landed is counted
            self._fleet.stored([n for n, _ in landed], [z for _, z in landed])
        if landed:
            self._identity.wrote(k for (k, _), e in zip(items, errors, strict=False) if e is None)
        return errors + refused

    def _read_pending(self, ks: list[str]) -> tuple[list[Chunk | None], list[int]]:
        """Chunks of keys whose put is still queued (they are the newest), and the indexes of the
        keys left to fetch from the store."""
        out: list[Chunk | None] = [None] * len(ks)
        if self._identity.unknown(len(ks)):  # not known yet (IdentityPending): misses
            return out, []
        todo: list[int] = []
        for i, k in enumerate(ks):
            pending = self._queue.pending(k)
            if pending is not None:
                out[i] = pending.toreadonly()
            else:
                todo.append(i)
        return out, todo

    def _fetch(self, keys: list[str]) -> list[ItemResult]:
        names = [self._name(k) for k in keys]
        return self._call_items(self._get_raw, "get", names)

    def _get_raw(self, names: list[str]) -> list[ItemResult]:
        if self.save_unfull_chunk or not self.serde.size_preserving:
            return self.reads.get_many(names)
        full = self.layout.full_chunk_bytes
        # Exactly-full-size buffers: a wrong-sized object fails with SizeMismatchError per item
        # and is never copied. np.empty does not touch the pages until the store writes them.
        return self.reads.get_many(names, [np.empty(full, dtype=np.uint8) for _ in names])

    def _decode(self, key: str, r: ItemResult) -> Chunk | None:
        chunk = self._decode_one(key, r)
        if chunk is None:  # missing, refused (the sealing layer removed it) or wrong: not "known"
            self._invalidate([r.name])
        return chunk

    def _decode_one(self, key: str, r: ItemResult) -> Chunk | None:
        if r.error is not None:
            if isinstance(r.error, SizeMismatchError):
                self._log_bad(key, str(r.error))
            else:
                self._read_failed(key, r.error)
            return None
        if r.size is None or r.data is None:
            return None
        if not self._size_ok(r.size):
            self._log_bad(key, f"stored object is {r.size} bytes, not the full chunk size")
            return None
        data = memoryview(r.data)
        chunk = self.serde.deserialize(data.cast("B") if data.format != "B" or data.ndim != 1 else data)
        view = as_view(chunk)
        if not self.save_unfull_chunk and view.nbytes != self.layout.full_chunk_bytes:
            self._log_bad(key, f"deserialized chunk is {view.nbytes} bytes, not the full chunk size")
            return None
        return view.toreadonly()

    def _log_bad(self, key: str, why: str) -> None:
        if key in self._logged_bad:
            return
        if len(self._logged_bad) > 10000:
            self._logged_bad.clear()
        self._logged_bad.add(key)
        log.warning(
            "refusing %s from %s: %s (a full chunk is %d bytes); treated as a miss",
            key, self.store.url, why, self.layout.full_chunk_bytes,
        )

    def _read_failed(self, key: str, err: Exception) -> None:
        """A read the store failed is a miss: counted in ``read_failures``, logged once per kind."""
        self.read_failures += 1
        if isinstance(err, CircuitOpenError):  # the breaker logged when it opened
            log.debug("get of %s skipped: %s", key, err)
            return
        _repeated.warning("get of %s from %s failed: %s", key, self.store.url, err, item=key)

    def _lookup_failed(self, n: int, err: Exception) -> None:
        """``n`` keys of a lookup are misses because the store failed: counted, logged once per kind."""
        self.lookup_failures += n
        if isinstance(err, CircuitOpenError):  # the breaker logged when it opened
            return
        _repeated.warning(
            "lookup on %s failed (%s: %s); answered as a miss", self.store.url, type(err).__name__, err,
            same=f"lookup on {self.store.url} failed: {type(err).__name__}",
        )

    def _cached_size(self, name: str) -> int | None:
        with self._exists_lock:
            entry = self._exists.get(name)
            if entry is None:
                return None
            if time.monotonic() - entry[1] > self._exists_ttl:
                del self._exists[name]
                return None
            return entry[0]

    def _cache_size(self, name: str, size: int) -> None:
        if not self._size_ok(size):
            return
        with self._exists_lock:
            self._exists[name] = (size, time.monotonic())
            self._exists.move_to_end(name)
            while len(self._exists) > self._exists_max:
                self._exists.popitem(last=False)

    def _invalidate(self, names: Iterable[str]) -> None:
        names = list(names)
        with self._exists_lock:
            for n in names:
                self._exists.pop(n, None)
        if isinstance(self.reads, PrefetchStore):  # written, removed, deleted by the fleet, or gone
            self.reads.forget(names)


class PipelinedRemoteBackend(RemoteBackend):
    """RemoteBackend whose ``batched_get`` overlaps fetching and deserializing.

    Keys are fetched in sub-batches of ``pipeline_batch`` on ``io_threads`` network threads,
    at most ``max_inflight`` sub-batches ahead of the consumer (a bounded queue), while a
    separate deserialize thread validates and decodes sub-batches that already arrived.
    Results come back in input order.
    """

    def __init__(
        self,
        store: ObjectStore,
        layout: KVLayout,
        *,
        pipeline_batch: int = 4,
        max_inflight: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(store, layout, **kwargs)
        if pipeline_batch <= 0 or max_inflight <= 0:
            raise ValueError("pipeline_batch and max_inflight must be positive")
        self.pipeline_batch = pipeline_batch
        self.max_inflight = max_inflight
        self._deser = DaemonThreadPool(1, "kvbucket-deserialize")

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        ks = [as_key_string(k) for k in keys]
        if len(ks) <= self.pipeline_batch:
            return super().batched_get(ks)
        out, todo = self._read_pending(ks)
        groups = [todo[j : j + self.pipeline_batch] for j in range(0, len(todo), self.pipeline_batch)]
        net: dict[int, Future[list[ItemResult]]] = {}
        decoded: list[Future[list[Chunk | None]]] = []

        def submit(g: int) -> None:
            if g < len(groups):
                net[g] = self._pool.submit(self._get_raw, [self._name(ks[i]) for i in groups[g]])

        def decode(g: int, results: list[ItemResult]) -> list[Chunk | None]:
            return [self._decode(ks[i], r) for i, r in zip(groups[g], results, strict=True)]

        # One bound for the whole read, however many sub-batches it takes.
        bound = self.blocking_timeout_secs
        deadline = None if bound is None else time.monotonic() + bound
        try:
            for g in range(min(self.max_inflight, len(groups))):
                submit(g)
            for g in range(len(groups)):
                try:
                    results = self._wait(net.pop(g), "get", deadline)
                except StoreError as e:  # blocking_timeout_secs: this group's keys are misses
                    results = [ItemResult(self._name(ks[i]), error=e) for i in groups[g]]
                submit(g + self.max_inflight)
                decoded.append(self._deser.submit(decode, g, results))
            for g, fut in enumerate(decoded):
                for i, chunk in zip(groups[g], fut.result(), strict=True):
                    out[i] = chunk
        finally:
            for fut in net.values():
                fut.cancel()
        self._loaded([ks[i] for i in todo if out[i] is not None])
        return out

    def _release(self) -> None:
        super()._release()
        self._deser.shutdown(wait=True)
