"""Reading kvbucket's metrics back: :func:`summarize` turns an exposition text into per-tier /
per-store rows for ``kvbucket stats`` and the demo; :func:`integrity_totals` and
:func:`integrity_failures` read the integrity counters of a registry. Re-exported by
:mod:`kvbucket.metrics`, next to the series it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families


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


__all__ = ["Row", "Summary", "integrity_failures", "integrity_totals", "summarize"]
