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
:func:`summarize` turns an exposition text back into per-tier / per-store rows for
``kvbucket stats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvbucket.backends.base import DEFAULT_FLUSH_TIMEOUT_SECS, Chunk, FlushResult, Key, StorageBackend
from kvbucket.errors import NoSpaceError
from kvbucket.metrics_server import MetricsServer, serve_metrics, start_metrics_server
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, Revision
from kvbucket.stores.guard import read_ahead as _prefetch
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


# ---- summaries (kvbucket stats, the demo) ----------------------------------------------------


@dataclass
class Row:
    """One tier or store: hits/misses of reads, objects written, bytes, mean read latency."""

    kind: str  # "tier" | "store"
    name: str
    hits: float = 0.0
    misses: float = 0.0
    errors: float = 0.0
    writes: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    read_seconds: float = 0.0
    read_calls: float = 0.0

    @property
    def hit_ratio(self) -> float | None:
        looked = self.hits + self.misses
        return self.hits / looked if looked else None

    @property
    def mean_read_ms(self) -> float | None:
        return 1000 * self.read_seconds / self.read_calls if self.read_calls else None


@dataclass
class Summary:
    rows: list[Row]
    prefix_tokens: dict[str, float]
    prefix_chunks: dict[str, float]
    integrity_verified: dict[str, float] = field(default_factory=dict)  # tier -> objects verified
    integrity_failures: dict[tuple[str, str], float] = field(default_factory=dict)  # (tier, reason)
    #: store -> breaker state ("closed", "half_open", "open") and objects its open breaker refused
    breakers: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: disk tier directory -> chunks skipped because its filesystem was full
    disk_skipped_full: dict[str, float] = field(default_factory=dict)
    #: (store, node) -> the fleet's usage as that member knows it (kvbucket.fleet.gauges):
    #: "used", "capacity", "chunks", "live_nodes"
    fleets: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    #: chunks fleet members evicted, by who wrote them ("self" / "other")
    fleet_evictions: dict[str, float] = field(default_factory=dict)
    #: refused objects removed from their store (damaged), by tier; the rest were kept
    integrity_removed: dict[str, float] = field(default_factory=dict)


_BREAKER_NAMES = {0: "closed", 1: "half_open", 2: "open"}
_FLEET_GAUGES = {"kvbucket_fleet_bytes_used": "used", "kvbucket_fleet_capacity_bytes": "capacity",
                 "kvbucket_fleet_chunks": "chunks", "kvbucket_fleet_live_nodes": "live_nodes"}
_READ_OPS = {"get", "batched_get"}


def summarize(exposition: str) -> Summary:
    """Fold a Prometheus text exposition into per-tier and per-store rows.

    Reads count ``get`` results (a ``contains`` probe is not a read); latency is the mean of the
    get calls. Works on any process's ``/metrics`` output, not only this one's.
    """
    rows: dict[tuple[str, str], Row] = {}
    prefix_tokens: dict[str, float] = {}
    prefix_chunks: dict[str, float] = {}
    verified: dict[str, float] = {}
    failures: dict[tuple[str, str], float] = {}
    removed: dict[str, float] = {}
    breakers: dict[str, tuple[str, float]] = {}
    disk_full: dict[str, float] = {}
    fleets: dict[tuple[str, str], dict[str, float]] = {}
    fleet_evictions: dict[str, float] = {}

    def row(kind: str, name: str) -> Row:
        return rows.setdefault((kind, name), Row(kind, name))

    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            lab, v = s.labels, float(s.value)
            if s.name == "kvbucket_backend_operations_total":
                r = row("tier", lab["tier"])
                _fold_op(r, lab["op"], lab["result"], v, read_ops={"get"}, write_ops={"put"})
            elif s.name == "kvbucket_store_objects_total":
                r = row("store", lab["store"])
                _fold_op(r, lab["op"], lab["result"], v, read_ops={"get"}, write_ops={"put"})
            elif s.name in ("kvbucket_backend_bytes_total", "kvbucket_store_bytes_total"):
                kind, name = ("tier", lab["tier"]) if "tier" in lab else ("store", lab["store"])
                r = row(kind, name)
                if lab["direction"] == "read":
                    r.bytes_read += v
                else:
                    r.bytes_written += v
            elif s.name in ("kvbucket_backend_latency_seconds_sum", "kvbucket_store_latency_seconds_sum"):
                if lab["op"] in _READ_OPS:
                    kind, name = ("tier", lab["tier"]) if "tier" in lab else ("store", lab["store"])
                    row(kind, name).read_seconds += v
            elif s.name in ("kvbucket_backend_latency_seconds_count", "kvbucket_store_latency_seconds_count"):
                if lab["op"] in _READ_OPS:
                    kind, name = ("tier", lab["tier"]) if "tier" in lab else ("store", lab["store"])
                    row(kind, name).read_calls += v
            elif s.name == "kvbucket_prefix_tokens_total":
                prefix_tokens[lab["result"]] = prefix_tokens.get(lab["result"], 0.0) + v
            elif s.name == "kvbucket_prefix_chunks_total":
                prefix_chunks[lab["result"]] = prefix_chunks.get(lab["result"], 0.0) + v
            elif s.name == "kvbucket_store_breaker_state":
                state = _BREAKER_NAMES.get(int(v), "unknown")
                breakers[lab["store"]] = (state, breakers.get(lab["store"], ("", 0.0))[1])
            elif s.name == "kvbucket_store_breaker_rejected_total":
                state, n = breakers.get(lab["store"], ("closed", 0.0))
                breakers[lab["store"]] = (state, n + v)
            elif s.name in _FLEET_GAUGES:
                fleets.setdefault((lab["store"], lab["node"]), {})[_FLEET_GAUGES[s.name]] = v
            elif s.name == "kvbucket_fleet_evictions_total":
                fleet_evictions[lab["writer"]] = fleet_evictions.get(lab["writer"], 0.0) + v
            elif s.name == "kvbucket_disk_skipped_full_total":
                disk_full[lab["dir"]] = disk_full.get(lab["dir"], 0.0) + v
            elif s.name == "kvbucket_integrity_verified_total":
                verified[lab["tier"]] = verified.get(lab["tier"], 0.0) + v
            elif s.name == "kvbucket_integrity_failures_total":
                k = (lab["tier"], lab["reason"])
                failures[k] = failures.get(k, 0.0) + v
            elif s.name == "kvbucket_integrity_removed_total":
                removed[lab["tier"]] = removed.get(lab["tier"], 0.0) + v
    ordered = sorted(rows.values(), key=lambda r: (r.kind != "tier", r.name))
    return Summary(ordered, prefix_tokens, prefix_chunks, verified, failures, breakers, disk_full, fleets,
                   fleet_evictions, removed)


def integrity_totals(registry: CollectorRegistry = REGISTRY) -> tuple[float, float]:
    """(objects verified, objects refused) on reads of every tier of this process so far."""
    verified = failures = 0.0
    for family in registry.collect():
        for s in family.samples:
            if s.name == "kvbucket_integrity_verified_total":
                verified += s.value
            elif s.name == "kvbucket_integrity_failures_total":
                failures += s.value
    return verified, failures


def integrity_failures(tier: str, reason: str, registry: CollectorRegistry = REGISTRY) -> float:
    """Objects one tier refused for one reason so far (``kvbucket_integrity_failures_total``)."""
    labels = {"tier": tier, "reason": reason}
    return registry.get_sample_value("kvbucket_integrity_failures_total", labels) or 0.0


def _fold_op(r: Row, op: str, result: str, v: float, *, read_ops: set[str], write_ops: set[str]) -> None:
    if result == "error":
        r.errors += v
    elif op in read_ops:
        if result == "hit":
            r.hits += v
        elif result == "miss":
            r.misses += v
    elif op in write_ops and result in ("ok", "accepted"):
        r.writes += v


__all__ = [
    "BACKEND_BYTES",
    "BACKEND_LATENCY",
    "BACKEND_OPS",
    "DISK_SKIPPED_FULL",
    "INTEGRITY_FAILURES",
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
]
