"""Fleet usage as Prometheus gauges, read from every live fleet member at scrape time.

``kvbucket stats`` (and any Prometheus) then shows, per store and node, the bytes the whole
fleet holds in the shared prefix against its capacity, the chunks and the live nodes: the same
numbers as ``report_status()["fleet"]``, for every kind of member (L2 adapters, LMCache's
non-MP connector, the engine tiers, the storage backends' remote tiers). A collector rather
than gauges set on every round: nothing runs on the fleet thread, and a closed member drops
out by itself (members are held weakly).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvbucket.fleet.sync import Fleet

_LABELS = ["store", "node"]


class _FleetCollector(Collector):
    def __init__(self) -> None:
        self._fleets: weakref.WeakKeyDictionary[Fleet, tuple[str, int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def track(self, fleet: Fleet, store_url: str, capacity: int) -> None:
        with self._lock:
            self._fleets[fleet] = (store_url, capacity)

    def forget(self, fleet: Fleet) -> None:
        with self._lock:
            self._fleets.pop(fleet, None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        used = GaugeMetricFamily("kvbucket_fleet_bytes_used",
                                 "Bytes the whole fleet holds in the shared prefix, as this node knows.",
                                 labels=_LABELS)
        cap = GaugeMetricFamily("kvbucket_fleet_capacity_bytes",
                                "The capacity the fleet shares (max_capacity_gb; 0: none).", labels=_LABELS)
        chunks = GaugeMetricFamily("kvbucket_fleet_chunks", "Chunks in the shared prefix.", labels=_LABELS)
        live = GaugeMetricFamily("kvbucket_fleet_live_nodes", "Nodes seen recently, this one included.",
                                 labels=_LABELS)
        with self._lock:
            fleets = list(self._fleets.items())
        for fleet, (url, capacity) in fleets:
            status = fleet.status()
            labels = [url, str(status["node"])]
            used.add_metric(labels, float(status["bytes_used"]))
            cap.add_metric(labels, float(capacity))
            chunks.add_metric(labels, float(status["chunks"]))
            live.add_metric(labels, float(len(status["live_nodes"])))
        yield from (used, cap, chunks, live)


_COLLECTOR = _FleetCollector()
REGISTRY.register(_COLLECTOR)


def track(fleet: Fleet, store_url: str, capacity: int) -> None:
    """Show ``fleet`` (on ``store_url``, sharing ``capacity`` bytes) in the gauges until it is
    closed (:func:`forget`) or garbage-collected."""
    _COLLECTOR.track(fleet, store_url, capacity)


def forget(fleet: Fleet) -> None:
    _COLLECTOR.forget(fleet)


__all__ = ["forget", "track"]
