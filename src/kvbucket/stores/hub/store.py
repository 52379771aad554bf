"""``HFBucketStore``: the object-store protocol over a Hugging Face Storage Bucket.

Objects live at ``<prefix>/<name>`` in the bucket named by ``hf://buckets/<ns>/<bucket>[/<prefix>]``.

How each verb maps onto the Hub (at most 1,000 paths or operations a request, the Hub's limit):

- ``put_many``: the bytes go to Xet storage (one upload commit per 1,000 objects, batches in
  parallel up to ``num_workers``); hf_xet takes ``bytes``, so each object is copied once, just
  before it is handed over (a :class:`Gather`, e.g. the envelope header + the caller's payload,
  is joined then: the copy of one object overlaps the upload of those before). Then one ``batch``
  request adds the paths. Batch writes are not transactional, so after any failure the bucket
  is asked (paths-info) which paths now hold exactly the uploaded content; those are reported
  stored, every other item gets its own error.
- ``head_many``: a TTL cache of exact size and hash (``metadata_cache_ttl_secs``), then one
  paths-info request per 1,000 unknown names.
- ``get_many``: metadata from the cache or paths-info (sizes are checked against the caller's
  buffers before a byte is written), then each object is streamed by hf_xet straight into the
  caller's buffer (or a new bytearray), ``num_workers`` at a time; no temp files.
- ``delete_many``: paths-info (exact sizes), one ``deleteFile`` batch, reconciliation as above.
- ``list``: the Hub's recursive tree listing, lazily, page by page.

Every verb has a total time budget (``lookup_timeout_secs`` for ``head_many``,
``load_timeout_secs`` for ``get_many``, ``store_timeout_secs`` for ``put_many``/``delete_many``;
each request is also bounded by ``connect_timeout_secs``/``request_timeout_secs``). Work hf_xet
cannot cancel is abandoned at the deadline and its items fail with DeadlineExceededError; a
circuit breaker (:mod:`kvbucket.stores.guard.breaker`) answers at once while the Hub is down.

Remote failures are per-item results (:class:`~kvbucket.stores.base.ItemResult` errors:
NotFoundError for a missing bucket, AuthError for a refused token, TransientStoreError after
the retries); only bad arguments or a closed store raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

from kvbucket.errors import (
    AuthError,
    ConfigError,
    DeadlineExceededError,
    NotFoundError,
    SizeMismatchError,
    StoreError,
    TransientStoreError,
)
from kvbucket.stores.base import (
    Buffer,
    Gather,
    ItemResult,
    ObjectInfo,
    Revision,
    VersionedDelete,
    check_buffer_size,
    check_name,
    closed_during,
)
from kvbucket.stores.buffers import put_view
from kvbucket.stores.deadline import Abandoned, Gate, deadline_in, exceeded, left, wait_all
from kvbucket.stores.guard.breaker import CircuitBreaker, RemoteStore
from kvbucket.stores.hub import versions as hub_versions
from kvbucket.stores.hub.client import HUB_BATCH_LIMIT, HubBucketClient, RemoteFile
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.loads import Load, Loads, fetch_jobs, settled
from kvbucket.stores.hub.meta_cache import MetaCache
from kvbucket.stores.hub.rechecks import Rechecks
from kvbucket.stores.hub.whoami import as_caller
from kvbucket.threads import DaemonThreadPool, submit_current

log = logging.getLogger(__name__)


class HFBucketStore(RemoteStore):
    """An :class:`ObjectStore` on a Hugging Face bucket. Thread-safe; sync (call from threads)."""

    gathers = True  # put_many takes a Gather: joined object by object as the upload takes them
    redirectable_reads = True  # every write into a Scatter is ``dst[a:b] = data`` (a read-ahead may move it)

    def __init__(self, config: HFBucketConfig, *, client: HubBucketClient | None = None,
                 prestart: bool = True) -> None:
        """``prestart=False``: start no thread until a batch needs it (one-shot CLI commands,
        which would pay ~20 ms per open starting threads they never use)."""
        if not isinstance(config, HFBucketConfig):
            raise ConfigError(f"HFBucketStore needs an HFBucketConfig, got {type(config).__name__}")
        config = config if client is not None else as_caller(config)  # `me`: the token's user, as on the Hub
        self.config = config
        loc = config.location
        self.bucket_id = loc.bucket_id
        self.prefix = loc.prefix
        self.url = loc.handle
        self._client = client or HubBucketClient(
            endpoint=config.resolved_endpoint(), bucket_id=self.bucket_id, token=config.resolved_token(),
            token_source=config.token_source(), max_retries=config.max_retries,
            retry_backoff_secs=config.retry_backoff_secs, connect_timeout_secs=config.connect_timeout_secs,
            request_timeout_secs=config.request_timeout_secs, load_concurrency=config.load_concurrency,
            xet_compression=config.xet_compression, read_connections=config.read_connections,
            read_part_bytes=config.read_part_bytes, read_min_part_bytes=config.read_min_part_bytes,
            read_slots=config.read_slots)
        self.endpoint = self._client.endpoint
        self._cache: MetaCache[RemoteFile] = MetaCache(config.metadata_cache_ttl_secs)
        # What this store committed is asked about again later: a racing delete's loss is added back.
        self.rechecks = Rechecks(self._client, self.url, config.recheck_delay_secs, self._cache)
        self._pool = DaemonThreadPool(config.num_workers, "kvbucket-hfbucket")  # never blocks exit
        # Loads: every object of a batch in flight at once (up to load_concurrency), so a load
        # costs one round trip (reconstruction, then fetch) whatever the number of objects.
        self._loads = DaemonThreadPool(config.load_concurrency, "kvbucket-hfbucket-load")
        if prestart:  # not in the first batch, where each start waits for the GIL
            self._loads.prestart()
            self._client.prestart_threads()
        self._pool_lock = threading.Lock()
        # Stores and deletes may ask which objects landed after their budget (one lookup more).
        look, write = config.lookup_timeout_secs, config.store_timeout_secs + config.lookup_timeout_secs
        self.breaker = CircuitBreaker(
            self.url, failures=config.breaker_failures, cooldown_secs=config.breaker_cooldown_secs,
            budgets={"head": look, "get": config.load_timeout_secs, "put": write, "delete": write},
        )
        self._create_lock = threading.Lock()
        self._bucket_ready = False
        self._closed = False
        self._live_loads = Loads()

    @classmethod
    def from_config(cls, config: HFBucketConfig) -> HFBucketStore:
        """The stable constructor for other layers (the MP L2 adapter passes its subclass config)."""
        return cls(config)

    def __repr__(self) -> str:
        return f"HFBucketStore({self.url!r}, endpoint={self.endpoint!r})"

    # ---- helpers ------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")

    def _map(self, fn: Callable[[Any], Any], items: Sequence[Any], inline: bool = True, loads: bool = False
             ) -> list[Future[Any]]:
        """Run ``fn`` over ``items`` on the worker pool, or the load pool with ``loads`` (leaf
        tasks only: no nested submits)."""
        if len(items) == 1 and inline:
            f: Future[Any] = Future()
            try:
                f.set_result(fn(items[0]))
            except BaseException as e:  # delivered through the future
                f.set_exception(e)
            return [f]
        def pool() -> DaemonThreadPool:  # the current one: _abandon_pool may swap it meanwhile
            return self._loads if loads else self._pool

        return [submit_current(pool, lambda: self._closed, fn, it) for it in items]

    def _gather(self, futures: list[Future[Any]], deadline: float, on_late: Callable[[int], Any],
                load: Load | None = None) -> list[Any]:
        """Results of ``futures`` in order; a future not done at ``deadline`` (or when close() ends
        the ``load``) gives ``on_late(i)``.

        Workers still busy then are stuck in calls hf_xet cannot cancel: the pool is replaced so
        that later calls do not queue behind them (their daemon threads end with the call).
        """
        if not (wait_all(futures, deadline + 0.05) if load is None else load.wait(futures, deadline + 0.05)):
            self._abandon_pool()  # not when closed
        out = []
        for i, fut in enumerate(futures):
            if not fut.done():
                out.append(on_late(i))
                continue
            try:
                out.append(fut.result())
            except CancelledError:
                out.append(on_late(i))
        return out

    def _named(self, results: list[ItemResult], what: str, option: str) -> list[ItemResult]:
        """Deadline errors from deep in a call say which option sets the budget that ran out."""
        named: dict[int, StoreError] = {}
        for k, r in enumerate(results):
            e = r.error
            if e is not None and isinstance(e, DeadlineExceededError) and "_timeout_secs=" not in str(e):
                if id(e) not in named:
                    base = exceeded(what, self.url, option, getattr(self.config, option))
                    named[id(e)] = DeadlineExceededError(f"{base} ({e})")
                results[k] = ItemResult(r.name, error=named[id(e)])
        return results

    def _abandon_pool(self) -> None:
        """Replace both pools (the stuck workers' daemon threads end with their calls)."""
        with self._pool_lock:
            old, old_loads = self._pool, self._loads
            if self._closed:
                return
            self._pool = DaemonThreadPool(self.config.num_workers, "kvbucket-hfbucket")
            self._loads = DaemonThreadPool(self.config.load_concurrency, "kvbucket-hfbucket-load")
            # Other calls' queued work moves with it, never cancelled (threads.DaemonThreadPool.hand_over).
            old.hand_over(self._pool)
            old_loads.hand_over(self._loads)
        log.warning("calls to %s passed their deadline and were abandoned", self.url)

    def _ensure_bucket(self, deadline: float | None = None) -> None:
        """Create the bucket (private) once, on the first store, when the config asks for it."""
        if self._bucket_ready or not self.config.create_bucket_if_missing:
            return
        with self._create_lock:
            if self._bucket_ready:
                return
            self._client.create_private(deadline)
            try:
                if not self._client.bucket_info(deadline).get("private", True):
                    log.warning("bucket %s already existed and is PUBLIC; KV caches hold users' prompts",
                                self.bucket_id)
            except StoreError:
                log.debug("could not read the info of bucket %s", self.bucket_id, exc_info=True)
            self._bucket_ready = True

    def _lookup(self, paths: Sequence[str], deadline: float, *, use_cache: bool = True
                ) -> dict[str, RemoteFile | None]:
        """Exact metadata of each path (None = missing): fresh cache entries, then paths-info.

        A missing bucket reads as "everything missing" when the store may create it; otherwise
        it raises NotFoundError (the caller turns it into per-item errors).
        """
        known: dict[str, RemoteFile | None] = self._cache.get_many(paths) if use_cache else {}
        unknown = list(dict.fromkeys(p for p in paths if p not in known))
        if unknown:
            chunks = [unknown[i : i + HUB_BATCH_LIMIT] for i in range(0, len(unknown), HUB_BATCH_LIMIT)]
            found: dict[str, RemoteFile] = {}
            since = self._cache.stamp()  # before asking: a put that returns meanwhile wins

            def late(i: int) -> dict[str, RemoteFile]:
                raise exceeded("a lookup", self.url, "lookup_timeout_secs", self.config.lookup_timeout_secs)

            try:
                futures = self._map(lambda c: self._client.paths_info(c, deadline), chunks)
                for part in self._gather(futures, deadline, late):
                    found.update(part)
            except NotFoundError:
                if not self.config.create_bucket_if_missing or self._bucket_ready:
                    raise
            fresh = [(p, found.get(p)) for p in unknown]
            self._cache.set_many(fresh, since=since)
            known.update(fresh)
        return known

    # ---- the protocol -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Buffer | Gather]]) -> list[ItemResult]:
        return self._named(self._put_many(items), "a store", "store_timeout_secs")

    def _put_many(self, items: Sequence[tuple[str, Buffer | Gather]]) -> list[ItemResult]:
        self._check_open()
        names = self._names([n for n, _ in items])
        views = [put_view(n, d) for n, (_, d) in zip(names, items, strict=True)]
        if not names:
            return []
        results: list[ItemResult | None] = [None] * len(names)
        # The last write of a name in one call wins (as with sequential puts); upload it once.
        last = {n: i for i, n in enumerate(names)}
        order = sorted(last.values())
        deadline = deadline_in(self.config.store_timeout_secs)
        try:
            self._ensure_bucket(deadline)
        except StoreError as e:
            return [ItemResult(n, error=e) for n in names]
        batches = [order[i : i + HUB_BATCH_LIMIT] for i in range(0, len(order), HUB_BATCH_LIMIT)]
        self._cache.written(self._path(names[i]) for i in order)

        def run(batch: list[int]) -> dict[int, ItemResult]:
            with self.rechecks.writing([self._path(names[i]) for i in batch]):
                return self._put_batch([(i, names[i], views[i]) for i in batch], deadline)

        def late(b: int) -> dict[int, ItemResult]:
            self._cache.written([self._path(names[i]) for i in batches[b]])
            err = exceeded("a store", self.url, "store_timeout_secs", self.config.store_timeout_secs)
            return {i: ItemResult(names[i], error=err) for i in batches[b]}

        for part in self._gather(self._map(run, batches), deadline, late):
            for i, r in part.items():
                results[i] = r
        for i, n in enumerate(names):
            if results[i] is None:  # an earlier duplicate: it was written, then overwritten
                winner = results[last[n]]
                results[i] = ItemResult(n, size=views[i].nbytes) if winner and winner.ok else winner
        return [r for r in results if r is not None]

    def _put_batch(self, batch: list[tuple[int, str, memoryview | Gather]], deadline: float
                   ) -> dict[int, ItemResult]:
        paths = [self._path(n) for _, n, _ in batch]
        try:
            uploaded = self._client.upload(
                [(p, v) for p, (_, _, v) in zip(paths, batch, strict=True)], deadline
            )
        except StoreError as e:  # nothing was added to the bucket: every item failed
            return {i: ItemResult(n, error=e) for i, n, _ in batch}
        mtime = int(time.time() * 1000)
        ops = [{"type": "addFile", "path": p, "xetHash": h, "mtime": mtime}
               for p, (h, _) in zip(paths, uploaded, strict=True)]
        failure: StoreError | None = None
        failed: dict[str, str] = {}
        try:
            failed = self._client.commit_batch(ops, deadline)
        except TransientStoreError as e:  # the outcome is unknown: the batch may have been applied
            failure = e
        except StoreError as e:  # refused as a whole (missing bucket, auth, bad request): nothing applied
            return {i: ItemResult(n, error=e) for i, n, _ in batch}
        if failure is None and not failed:
            self._cache.set_written(
                (p, RemoteFile(p, size, h)) for p, (h, size) in zip(paths, uploaded, strict=True)
            )
            out = {i: ItemResult(n, size=size, version=h)
                   for (i, n, _), (h, size) in zip(batch, uploaded, strict=True)}
        else:
            out = self._reconcile_put(batch, paths, uploaded, failed, failure, deadline)
        self.rechecks.committed(paths, [out[i] for i, _, _ in batch], mtime)
        return out

    def _reconcile_put(
        self, batch: list[tuple[int, str, memoryview | Gather]], paths: list[str],
        uploaded: list[tuple[str, int]], failed: dict[str, str], failure: StoreError | None, deadline: float,
    ) -> dict[int, ItemResult]:
        """After a failed or partial batch, count exactly the paths that hold our new content.

        The check gets at least ``lookup_timeout_secs`` even when the batch used up the budget.
        """
        self._cache.written(paths)  # the batch is over: answers asked before now may be older
        since = self._cache.stamp()
        try:
            now = self._client.paths_info(
                paths, max(deadline, deadline_in(self.config.lookup_timeout_secs))
            )
        except StoreError as e:
            why = failure or StoreError(f"{len(failed)} of {len(paths)} writes failed")
            err = StoreError(f"{why}; and whether the others landed could not be checked: {e}")
            return {i: ItemResult(n, error=err) for i, n, _ in batch}
        self._cache.set_many(((p, now.get(p)) for p in paths), since=since)
        out: dict[int, ItemResult] = {}
        for (i, n, _), p, (h, size) in zip(batch, paths, uploaded, strict=True):
            f = now.get(p)
            if f is not None and f.xet_hash == h and f.size == size:
                out[i] = ItemResult(n, size=size, version=h)
            else:
                msg = failed.get(p) or (str(failure) if failure else "the Hub did not apply this write")
                out[i] = ItemResult(n, error=StoreError(f"object {n!r} was not stored in {self.url}: {msg}"))
        log.warning("partial batch on %s: %d of %d objects stored", self.url,
                    sum(r.ok for r in out.values()), len(out))
        return out

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self._named(self._head_many(names), "a lookup", "lookup_timeout_secs")

    def _head_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._check_open()
        names = self._names(names)
        paths = [self._path(n) for n in names]
        self._client.warm_reads()  # a hit is loaded next: its read token overlaps this lookup
        try:
            meta = self._lookup(paths, deadline_in(self.config.lookup_timeout_secs))
        except StoreError as e:
            return [ItemResult(n, error=e) for n in names]
        if self.config.prefetch_reconstructions:  # a hit is loaded next: its load is the fetch alone
            hits = [f for f in meta.values() if f is not None]
            self._client.prefetch_reconstructions(hits, background=True)  # the lookup does not wait
        return [ItemResult(n) if (f := meta[p]) is None
                else ItemResult(n, size=f.size, version=f.xet_hash or None)
                for n, p in zip(names, paths, strict=True)]

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        return self._named(self._get_many(names, out), "a load", "load_timeout_secs")

    def _get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None) -> list[ItemResult]:
        self._check_open()
        names = self._names(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        paths = [self._path(n) for n in names]
        deadline = deadline_in(self.config.load_timeout_secs)
        self._client.warm_reads()  # the read token's request overlaps the lookup's
        try:  # the metadata is a lookup: a Hub that does not answer it in time is not answering
            meta = self._lookup(paths, min(deadline, deadline_in(self.config.lookup_timeout_secs)))
        except StoreError as e:
            if self._closed:  # e.g. its client closed under it
                return [ItemResult(n, error=closed_during(self.url)) for n in names]
            if isinstance(e, DeadlineExceededError):  # name the budget that ran out
                base = exceeded("the lookup part of a load", self.url, "lookup_timeout_secs",
                                self.config.lookup_timeout_secs)
                e = DeadlineExceededError(f"{base} ({e})")
            return [ItemResult(n, error=e) for n in names]
        results: list[ItemResult | None] = [None] * len(names)
        jobs: list[tuple[int, RemoteFile, memoryview, Buffer]] = []
        for i, (n, p) in enumerate(zip(names, paths, strict=True)):
            f = meta[p]
            if f is None:
                results[i] = ItemResult(n)
                continue
            buf = out[i] if out is not None else None
            if buf is None:
                target: Buffer = bytearray(f.size)
                view = memoryview(target)
            else:
                try:
                    view = check_buffer_size(n, f.size, buf)
                except StoreError as e:
                    results[i] = ItemResult(n, error=e)
                    continue
                target = buf
            jobs.append((i, f, view, target))

        if not jobs:
            return [r for r in results if r is not None]
        gates = [Gate() for _ in jobs]
        load = self._live_loads.start(gates)  # close() closes the gates and wakes this call
        try:
            fetched = None if load.ended else fetch_jobs(self, names, out, jobs, gates, load, deadline)
        finally:
            self._live_loads.finish(load)
        if fetched is None:  # closed before a fetch was sent
            fetched = [(list(range(len(jobs))), [ItemResult(names[j[0]], error=closed_during(self.url))
                                                 for j in jobs])]
        for ks, rs in fetched:
            for k, r in zip(ks, settled(rs, load, self.url, [gates[k] for k in ks]), strict=True):
                results[jobs[k][0]] = r
        return [r for r in results if r is not None]

    def _download(self, name: str, f: RemoteFile, view: memoryview, target: Buffer, caller_buffer: bool,
                  gate: Gate, deadline: float) -> ItemResult:
        """Stream one object into ``view``; on failure, back off, re-read its metadata, try again.

        A cached hash can be stale (overwritten elsewhere), and a just-committed object can be
        briefly unreadable while its storage metadata settles (seen under concurrent identical
        uploads), so a failed read is retried with fresh metadata up to ``max_retries`` times.
        """
        delay = self.config.retry_backoff_secs
        for attempt in range(self.config.max_retries + 1):
            try:
                self._client.download_into(f, view, gate, deadline)
                return ItemResult(name, size=f.size, data=target)
            except Abandoned:
                return ItemResult(name, error=exceeded(
                    "a load", self.url, "load_timeout_secs", self.config.load_timeout_secs))
            except Exception as e:  # becomes this item's error, unless a retry succeeds
                err = self._client.error(e, f"download {f.path!r}")
            wait = min(delay, 8.0)
            if attempt == self.config.max_retries or isinstance(err, AuthError) or wait >= left(deadline):
                break
            time.sleep(wait)
            delay *= 2
            self._client.reset_download_group()  # a new group also gets a fresh read token
            since = self._cache.stamp()
            try:
                fresh = self._client.paths_info([f.path], deadline).get(f.path)
            except StoreError as e:
                return ItemResult(name, error=e)
            self._cache.set_many([(f.path, fresh)], since=since)
            if fresh is None:
                return ItemResult(name)  # deleted meanwhile: a miss
            if fresh.size != f.size:
                if caller_buffer:
                    return ItemResult(name, error=SizeMismatchError(
                        f"object {name!r} now has {fresh.size} bytes but its buffer has {f.size}"))
                target = bytearray(fresh.size)
                view = memoryview(target)
            f = fresh
        self._cache.invalidate([f.path])
        return ItemResult(name, error=err)

    def get_if_changed(self, name: str, tag: str | None) -> Revision:
        """A fresh paths-info (one request) compares the file's Xet hash with ``tag``; only a
        changed file is downloaded (its metadata is then in the cache: no second lookup)."""
        self._check_open()
        (name,) = self._names([name])
        path = self._path(name)
        meta = self._lookup([path], deadline_in(self.config.lookup_timeout_secs), use_cache=False)[path]
        if meta is None:
            return Revision(None)
        if meta.xet_hash == tag:
            return Revision(tag)
        (r,) = self.get_many([name])
        if r.error is not None:
            raise r.error
        return Revision(meta.xet_hash, None if r.data is None else bytes(r.data))

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self._named(self._delete_many(names), "a delete", "store_timeout_secs")

    def _delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._check_open()
        names = self._names(names)
        if not names:
            return []
        paths = [self._path(n) for n in names]
        deadline = deadline_in(self.config.store_timeout_secs)
        try:
            before = self._lookup(paths, deadline, use_cache=False)
        except StoreError as e:
            return [ItemResult(n, error=e) for n in names]
        present = list(dict.fromkeys(p for p in paths if before[p] is not None))
        self.rechecks.forget(present)  # removed on purpose: not to be added back
        self._cache.written(present)
        failed: dict[str, StoreError] = {}
        chunks = [present[i : i + HUB_BATCH_LIMIT] for i in range(0, len(present), HUB_BATCH_LIMIT)]

        def run(chunk: list[str]) -> dict[str, StoreError]:
            return self._delete_batch(chunk, deadline)

        def late(c: int) -> dict[str, StoreError]:
            self._cache.written(chunks[c])
            err = exceeded("a delete", self.url, "store_timeout_secs", self.config.store_timeout_secs)
            return dict.fromkeys(chunks[c], err)

        for part in self._gather(self._map(run, chunks), deadline, late):
            failed.update(part)
        self._cache.set_written((p, None) for p in present if p not in failed)
        self._cache.written(failed)  # partly removed, or not: answers asked before now may be older
        out = []
        for n, p in zip(names, paths, strict=True):
            f = before[p]
            if p in failed:
                out.append(ItemResult(n, error=failed[p]))
            else:
                out.append(ItemResult(n, size=None if f is None else f.size))
        return out

    def _delete_batch(self, chunk: list[str], deadline: float) -> dict[str, StoreError]:
        err: StoreError | None = None
        failed: dict[str, str] = {}
        try:
            failed = self._client.commit_batch([{"type": "deleteFile", "path": p} for p in chunk], deadline,
                                               "remove objects")
        except TransientStoreError as e:
            err = e
        except StoreError as e:
            return dict.fromkeys(chunk, e)
        if err is None and not failed:
            return {}
        self._cache.written(chunk)
        try:
            still = self._client.paths_info(
                chunk, max(deadline, deadline_in(self.config.lookup_timeout_secs))
            )
        except StoreError as e:
            return {p: StoreError(f"{err or 'delete failed'}; could not check what was removed: {e}")
                    for p in chunk}
        return {p: StoreError(f"{p!r} was not removed from {self.url}: {failed.get(p) or err}")
                for p in chunk if p in still}

    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        """Whole objects and their Xet hashes, read afresh (stores/hub/versions.py)."""
        self._check_open()
        return hub_versions.get_versions(self, self._names(names))

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        """Compare each Xet hash, then one batch delete (stores/hub/versions.py)."""
        self._check_open()
        return hub_versions.delete_versions(self, self._names([n for n, _ in items]), [v for _, v in items])

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        """Objects whose name starts with ``prefix``, in the Hub's order, fetched lazily."""
        self._check_open()
        if not isinstance(prefix, str):
            raise TypeError("prefix must be a str")
        if prefix:
            check_name(prefix.rstrip("/") or "x")
        full = self._path(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        directory = full.rsplit("/", 1)[0] if "/" in full else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        return self._list(directory, full, strip)

    def _list(self, directory: str, full: str, strip: int) -> Iterator[ObjectInfo]:
        since = self._cache.stamp()
        try:
            for f in self._client.list_tree(directory):
                if f.path.startswith(full) and len(f.path) > strip:
                    self._cache.set_many([(f.path, f)], since=since)
                    yield ObjectInfo(f.path[strip:], f.size, f.mtime, f.xet_hash or None)
        except NotFoundError:
            if not self.config.create_bucket_if_missing:
                raise

    def close(self) -> None:
        if self._closed:
            return
        self.rechecks.close()  # the pending checks, at once
        self._closed = True
        self._live_loads.close()  # loads in flight end now: their gates closed, their callers woken
        self.breaker.close()
        with self._pool_lock:  # after _closed: _abandon_pool swaps no pool in past here
            pool, loads = self._pool, self._loads
        pool.shutdown(wait=True, cancel_futures=True)
        loads.shutdown(wait=True, cancel_futures=True)
        self._client.close()
        self._cache.clear()


__all__ = ["HFBucketConfig", "HFBucketStore"]
