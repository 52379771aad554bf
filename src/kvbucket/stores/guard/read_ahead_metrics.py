"""The read-ahead's counters (:mod:`kvbucket.stores.guard.read_ahead`, re-exported by
:mod:`kvbucket.metrics`): bytes by outcome, and the bytes held and pooled."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

READ_AHEAD_BYTES = Counter(
    "kvbucket_read_ahead_bytes",
    "Read-ahead bytes by outcome: prefetched (landed after a lookup hit), used (served to a load), "
    "wasted (dropped unused: expired, overwritten, deleted, closed).",
    ["store", "outcome"],
)
READ_AHEAD_HELD = Gauge(
    "kvbucket_read_ahead_held_bytes", "Bytes the read-ahead buffer holds (in flight or landed).", ["store"]
)
READ_AHEAD_POOLED = Gauge(
    "kvbucket_read_ahead_pooled_bytes",
    "Bytes of free read-ahead buffers kept for the next read-aheads (held + pooled: the memory the "
    "read-ahead holds, within read_ahead_max_gb).", ["store"]
)

class _Unexported:
    """A series nobody exports (metrics off): its moves go nowhere."""

    def inc(self, amount: float = 1) -> None:
        pass


def read_ahead_series(label: str, exported: bool) -> tuple[Any, Any, Any, Any, Any]:
    """One store's series: bytes prefetched, used, wasted; the held and pooled gauges. With
    ``exported`` false none is created, so no ``store=<label>`` series appears at all."""
    if not exported:
        return (_Unexported(),) * 5
    return (READ_AHEAD_BYTES.labels(label, "prefetched"), READ_AHEAD_BYTES.labels(label, "used"),
            READ_AHEAD_BYTES.labels(label, "wasted"), READ_AHEAD_HELD.labels(label),
            READ_AHEAD_POOLED.labels(label))


__all__ = ["READ_AHEAD_BYTES", "READ_AHEAD_HELD", "READ_AHEAD_POOLED", "read_ahead_series"]
