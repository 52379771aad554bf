"""Prometheus metrics for operators: hits, misses, bytes and latency per tier and per store.

Instrumentation is a pair of thin wrappers, so no other module has to know about metrics:

- :class:`InstrumentedBackend` wraps any :class:`~kvbucket.backends.base.StorageBackend` and labels
  its counters with a *tier* name (``local_cpu``, ``local_disk``, ``remote``, ...).
- :class:`InstrumentedStore` wraps any :class:`~kvbucket.stores.base.ObjectStore` and labels its
  counters with a *store* name (``hf``, ``s3``, ``file``, ...).

Counters count only what happened: a put that raised is an ``error``, never bytes written; a
non-blocking put is ``accepted`` (it may still fail later), and its bytes are not counted.
:func:`start_metrics_server` exposes the default registry over HTTP (``/metrics``;
:func:`serve_metrics` once per process, for the engines' ``metrics_port`` settings, both in
:mod:`kvbucket.metrics_server`), and
:func:`summarize` (in :mod:`kvbucket.metrics_summary`) turns an exposition text back into
per-tier / per-store rows for ``kvbucket stats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kvbucket.backends.base import DEFAULT_FLUSH_TIMEOUT_SECS, Chunk, FlushResult, Key, StorageBackend
from kvbucket.errors import NoSpaceError
from kvbucket.metrics_server import MetricsServer, serve_metrics, start_metrics_server
from kvbucket.metrics_summary import Row, Summary, integrity_failures, integrity_totals, summarize
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, Revision
from kvbucket.stores.guard import read_ahead as _prefetch
from kvbucket.stores.guard import refusals as _refusals
from kvbucket.stores.guard import sealed as _sealed

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0
)

BACKEND_OPS = Counter(
    "kvbucket_backend_operations",
    "Chunk operations per tier, by operation and result (hit/miss/ok/accepted/error/skipped: a "
    "local tier whose filesystem was full).",
    ["tier", "op", "result"],
)
BACKEND_BYTES = Counter(
    "kvbucket_backend_bytes", "Chunk bytes read from / written to a tier.", ["tier", "direction"]
)
BACKEND_LATENCY = Histogram(
    "kvbucket_backend_latency_seconds",
    "Latency of one backend call (a batched call counts once).",
    ["tier", "op"],
    buckets=_LATENCY_BUCKETS,
)
STORE_OBJECTS = Counter(
    "kvbucket_store_objects",
    "Objects handled by an object store, by operation and result (hit/miss/ok/error).",
    ["store", "op", "result"],
)
STORE_BYTES = Counter(
    "kvbucket_store_bytes", "Object bytes read from / written to a store.", ["store", "direction"]
)
STORE_LATENCY = Histogram(
    "kvbucket_store_latency_seconds",
    "Latency of one object-store batch call.",
    ["store", "op"],
    buckets=_LATENCY_BUCKETS,
)
STORE_BREAKER_STATE = Gauge(
    "kvbucket_store_breaker_state",
    "Circuit breaker of a remote store: 0 closed (calls go through), 1 half-open (probing), 2 open.",
    ["store"],
)
STORE_BREAKER_OPENS = Counter(
    "kvbucket_store_breaker_opens", "Times a remote store's circuit breaker opened.", ["store"]
)
STORE_BREAKER_REJECTED = Counter(
    "kvbucket_store_breaker_rejected",
    "Objects of calls answered at once by an open circuit breaker (lookups missed, stores dropped).",
    ["store", "op"],
)
DISK_SKIPPED_FULL = Counter(
    "kvbucket_disk_skipped_full",
    "Chunks a disk tier skipped because its filesystem was full even after evicting (blocking and "
    "queued puts; the other tiers still stored them).",
    ["dir"],
)
PREFIX_TOKENS = Counter(
    "kvbucket_prefix_tokens",
    "Prompt tokens whose KV was loaded from the cache (hit) or computed by the model (computed).",
    ["result"],
)
PREFIX_CHUNKS = Counter(
    "kvbucket_prefix_chunks",
    "Prefix chunks handled: loaded, stored, store_failed, dropped (store queue full).",
    ["result"],
)
PREFIX_SECONDS = Histogram(
    "kvbucket_prefix_seconds",
    "Time spent on the critical path of a prefill, by phase (lookup, load, compute).",
    ["phase"],
    buckets=_LATENCY_BUCKETS,
)
# Integrity counters live next to the code that counts them (kvbucket.stores.guard.sealed, which
# cannot import this module: backends import it); re-exported here with the others.
INTEGRITY_FAILURES = _sealed.INTEGRITY_FAILURES
INTEGRITY_VERIFIED = _sealed.INTEGRITY_VERIFIED
INTEGRITY_REMOVED = _sealed.INTEGRITY_REMOVED
# Damage read again before removal (damaged / intact / failed), and deletes kvbucket decided on
# its own that found a newer version (kept), by path (kvbucket.stores.guard.refusals).
INTEGRITY_REREADS = _refusals.INTEGRITY_REREADS
DELETES_KEPT = _refusals.DELETES_KEPT
# Read-ahead counters (kvbucket.stores.guard.read_ahead): prefetched / used / wasted bytes, held and
# pooled bytes.
READ_AHEAD_BYTES = _prefetch.READ_AHEAD_BYTES
READ_AHEAD_HELD = _prefetch.READ_AHEAD_HELD
READ_AHEAD_POOLED = _prefetch.READ_AHEAD_POOLED


def _nbytes(chunk: Any) -> int:
    nbytes = getattr(chunk, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return memoryview(chunk).nbytes
    except TypeError:
        return 0


class InstrumentedBackend(StorageBackend):
    """A :class:`StorageBackend` that counts what passes through it, labelled ``tier``.

    Everything not in the interface is delegated to the wrapped backend, so code holding the
    wrapper can still reach backend-specific methods.
    """

    def __init__(self, inner: StorageBackend, tier: str) -> None:
        if not tier:
            raise ValueError("InstrumentedBackend needs a tier name, e.g. 'remote'")
        self.inner = inner
        self.tier = tier

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"InstrumentedBackend({self.inner!r}, tier={self.tier!r})"

    def _time(self, op: str) -> _Timer:
        return _Timer(BACKEND_LATENCY.labels(self.tier, op))

    def _count(self, op: str, result: str, n: int = 1) -> None:
        if n:
            BACKEND_OPS.labels(self.tier, op, result).inc(n)

    def _count_get(self, chunk: Chunk | None) -> None:
        if chunk is None:
            self._count("get", "miss")
        else:
            self._count("get", "hit")
            BACKEND_BYTES.labels(self.tier, "read").inc(_nbytes(chunk))

    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        with self._time("put"):
            try:
                self.inner.put(key, chunk, blocking=blocking)
            except NoSpaceError:
                self._count("put", "skipped")
                raise
            except Exception:
                self._count("put", "error")
                raise
        if blocking:
            self._count("put", "ok")
            BACKEND_BYTES.labels(self.tier, "write").inc(_nbytes(chunk))
        else:
            self._count("put", "accepted")

    def get(self, key: Key) -> Chunk | None:
        with self._time("get"):
            try:
                chunk = self.inner.get(key)
            except Exception:
                self._count("get", "error")
                raise
        self._count_get(chunk)
        return chunk

    def contains(self, key: Key) -> bool:
        with self._time("contains"):
            try:
                found = self.inner.contains(key)
            except Exception:
                self._count("contains", "error")
                raise
        self._count("contains", "hit" if found else "miss")
        return found

    def batched_contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is stored; uses the inner backend's batched form when it has one."""
        inner = getattr(self.inner, "batched_contains", None)
        with self._time("batched_contains"):
            try:
                found = list(inner(keys)) if callable(inner) else [self.inner.contains(k) for k in keys]
            except Exception:
                self._count("contains", "error", len(keys))
                raise
        hits = sum(1 for f in found if f)
        self._count("contains", "hit", hits)
        self._count("contains", "miss", len(found) - hits)
        return found

    def remove(self, key: Key) -> bool:
        with self._time("remove"):
            try:
                removed = self.inner.remove(key)
            except Exception:
                self._count("remove", "error")
                raise
        self._count("remove", "ok" if removed else "miss")
        return removed

    def list(self) -> list[str]:
        with self._time("list"):
            return self.inner.list()

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        items = list(items)
        with self._time("batched_put"):
            try:
                results = self.inner.batched_put_results(items, blocking=blocking)
            except Exception:
                self._count("put", "error", len(items))
                raise
        landed = [chunk for (_, chunk), err in zip(items, results, strict=True) if err is None]
        skipped = sum(isinstance(err, NoSpaceError) for err in results)
        self._count("put", "skipped", skipped)
        self._count("put", "error", len(items) - len(landed) - skipped)
        if blocking:
            self._count("put", "ok", len(landed))
            BACKEND_BYTES.labels(self.tier, "write").inc(sum(_nbytes(c) for c in landed))
        else:  # accepted into a queue: it may still fail, so no bytes are counted
            self._count("put", "accepted", len(landed))
        return results

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        with self._time("batched_get"):
            try:
                chunks = list(self.inner.batched_get(keys))
            except Exception:
                self._count("get", "error", len(keys))
                raise
        for c in chunks:
            self._count_get(c)
        return chunks

    def get_into(self, key: Key, buffer: Chunk) -> bool:
        """The inner tier's own ``get_into`` (straight into the caller's buffer), counted."""
        with self._time("get_into"):
            try:
                hit = self.inner.get_into(key, buffer)
            except Exception:
                self._count("get", "error")
                raise
        self._count_into([hit], [buffer])
        return hit

    def batched_get_into(self, keys: Sequence[Key], buffers: Sequence[Chunk]) -> list[bool]:
        """The inner tier's own ``batched_get_into`` (no intermediate copy), counted."""
        with self._time("batched_get_into"):
            try:
                hits = list(self.inner.batched_get_into(keys, buffers))
            except Exception:
                self._count("get", "error", len(keys))
                raise
        self._count_into(hits, buffers)
        return hits

    def _count_into(self, hits: Sequence[bool], buffers: Sequence[Chunk]) -> None:
        n = sum(1 for h in hits if h)
        self._count("get", "hit", n)
        self._count("get", "miss", len(hits) - n)
        if n:
            read = sum(_nbytes(b) for b, h in zip(buffers, hits, strict=True) if h)
            BACKEND_BYTES.labels(self.tier, "read").inc(read)

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_SECS) -> FlushResult:
        return self.inner.flush(timeout)

    def close(self) -> None:
        self.inner.close()


class InstrumentedStore(ObjectStore):
    """An :class:`ObjectStore` that counts objects, bytes and batch latency, labelled ``store``.

    Wrap the store that makes the requests (under the sealing layer and the read-ahead buffer),
    so bytes and latency are those of real requests. Label children are made once per store
    (``labels()`` takes a lock and a dict lookup per call)."""

    _OPS = ("put", "get", "head", "delete", "get_if_changed")

    def __init__(self, inner: ObjectStore, name: str | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.name = name or (inner.url.partition("://")[0] if "://" in inner.url else type(inner).__name__)
        self._latency = {op: STORE_LATENCY.labels(self.name, op) for op in self._OPS}
        self._read = STORE_BYTES.labels(self.name, "read")
        self._written = STORE_BYTES.labels(self.name, "write")
        self._objects: dict[tuple[str, str], Any] = {}
        if hasattr(inner, "get_each"):  # a directory: the sealing layer's encrypted loads use it
            self.get_each = self._get_each

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (during __init__ or unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"InstrumentedStore({self.inner!r}, name={self.name!r})"

    def _add(self, op: str, result: str, n: int) -> None:
        child = self._objects.get((op, result))
        if child is None:
            child = self._objects[(op, result)] = STORE_OBJECTS.labels(self.name, op, result)
        child.inc(n)

    def _count(self, op: str, results: Sequence[ItemResult], *, found: str, missing: str) -> None:
        tally: dict[str, int] = {}
        for r in results:
            key = "error" if r.error is not None else (found if r.size is not None else missing)
            tally[key] = tally.get(key, 0) + 1
        for result, n in tally.items():
            self._add(op, result, n)

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        with _Timer(self._latency["put"]):
            results = self.inner.put_many(items)
        self._count("put", results, found="ok", missing="ok")
        self._written.inc(sum(r.size or 0 for r in results if r.error is None))
        return results

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        with _Timer(self._latency["get"]):
            results = self.inner.get_many(names, out)
        return self._count_reads(results)

    def _get_each(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None,
                  after: Any = None) -> list[ItemResult]:
        with _Timer(self._latency["get"]):
            results = self.inner.get_each(names, out, after)  # type: ignore[attr-defined]
        return self._count_reads(results)

    def _count_reads(self, results: list[ItemResult]) -> list[ItemResult]:
        self._count("get", results, found="hit", missing="miss")
        self._read.inc(sum(r.size or 0 for r in results if r.error is None))
        return results

    def get_if_changed(self, name: str, tag: str | None) -> Revision:
        """The inner store's conditional read (one small request when unchanged), counted as
        ``get_if_changed``: ``hit`` (read), ``unchanged``, ``miss`` or ``error``."""
        with _Timer(self._latency["get_if_changed"]):
            try:
                rev = self.inner.get_if_changed(name, tag)
            except Exception:
                self._add("get_if_changed", "error", 1)
                raise
        result = "miss" if rev.tag is None else ("unchanged" if rev.data is None else "hit")
        self._add("get_if_changed", result, 1)
        if rev.data is not None:
            self._read.inc(len(rev.data))
        return rev

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        with _Timer(self._latency["head"]):
            results = self.inner.head_many(names)
        self._count("head", results, found="hit", missing="miss")
        return results

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        with _Timer(self._latency["delete"]):
            results = self.inner.delete_many(names)
        self._count("delete", results, found="ok", missing="miss")
        return results

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, page_size=page_size)

    def close(self) -> None:
        self.inner.close()


def uninstrumented(obj: Any) -> Any:
    """The tier or store under kvbucket's metrics wrappers (``build_backend`` wraps every tier
    and remote store unless ``extra_config.metrics`` is false); anything else as is."""
    while isinstance(obj, InstrumentedBackend | InstrumentedStore):
        obj = obj.inner
    return obj


class _Timer:
    """Observe the wall time of a ``with`` block into a histogram child (also on error)."""

    __slots__ = ("_child", "_t0")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._t0 = 0.0

    def __enter__(self) -> _Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._child.observe(time.perf_counter() - self._t0)


__all__ = [
    "BACKEND_BYTES",
    "BACKEND_LATENCY",
    "BACKEND_OPS",
    "DELETES_KEPT",
    "DISK_SKIPPED_FULL",
    "INTEGRITY_FAILURES",
    "INTEGRITY_REREADS",
    "INTEGRITY_VERIFIED",
    "PREFIX_CHUNKS",
    "PREFIX_SECONDS",
    "PREFIX_TOKENS",
    "READ_AHEAD_BYTES",
    "READ_AHEAD_HELD",
    "READ_AHEAD_POOLED",
    "STORE_BREAKER_OPENS",
    "STORE_BREAKER_REJECTED",
    "STORE_BREAKER_STATE",
    "STORE_BYTES",
    "STORE_LATENCY",
    "STORE_OBJECTS",
    "InstrumentedBackend",
    "InstrumentedStore",
    "MetricsServer",
    "Row",
    "Summary",
    "integrity_failures",
    "integrity_totals",
    "serve_metrics",
    "start_metrics_server",
    "summarize",
    "uninstrumented",
]
