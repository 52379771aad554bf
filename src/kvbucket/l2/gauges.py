"""Capacity, usage and evictions of every L2 adapter that has a capacity, as Prometheus series.

``kvbucket_l2_capacity_bytes``, ``kvbucket_l2_bytes_used`` and ``kvbucket_l2_evictions_total`` /
``kvbucket_l2_evicted_bytes_total`` (labelled by store URL) are exported whenever
``max_capacity_gb`` is set, with or without a fleet: the Grafana dashboard's capacity row reads
them (a fleet's own ``kvbucket_fleet_*`` series add what the whole fleet holds). A collector
read at scrape time, adapters held weakly: a closed adapter drops out by itself, and nothing
runs on the adapter's paths.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LABELS = ["store"]


class _L2Collector(Collector):
    def __init__(self) -> None:
        self._adapters: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def track(self, adapter: Any, store_url: str, capacity: int) -> None:
        with self._lock:
            self._adapters[adapter] = (store_url, capacity)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cap = GaugeMetricFamily("kvbucket_l2_capacity_bytes",
                                "The L2 adapter's capacity (max_capacity_gb).", labels=_LABELS)
        used = GaugeMetricFamily("kvbucket_l2_bytes_used",
                                 "Bytes the L2 adapter counts against its capacity (with a fleet: the "
                                 "fleet's).", labels=_LABELS)
        evictions = CounterMetricFamily("kvbucket_l2_evictions", "Keys the L2 adapter evicted.",
                                        labels=_LABELS)
        evicted = CounterMetricFamily("kvbucket_l2_evicted_bytes", "Bytes the L2 adapter evicted.",
                                      labels=_LABELS)
        totals: dict[str, list[float]] = {}  # store -> capacity, used, evicted keys, evicted bytes
        with self._lock:
            adapters = list(self._adapters.items())
        for adapter, (url, capacity) in adapters:
            if adapter.closed:
                continue
            usage = adapter.get_usage()
            stats = adapter.stats()
            row = totals.setdefault(url, [0.0, 0.0, 0.0, 0.0])
            row[0] = max(row[0], float(capacity))
            row[1] = max(row[1], float(usage.bytes_used))
            row[2] += float(stats.get("evicted_keys", 0))
            row[3] += float(stats.get("evicted_bytes", 0))
        for url, (c, u, k, b) in totals.items():
            cap.add_metric([url], c)
            used.add_metric([url], u)
            evictions.add_metric([url], k)
            evicted.add_metric([url], b)
        yield from (cap, used, evictions, evicted)


_COLLECTOR = _L2Collector()
REGISTRY.register(_COLLECTOR)


def track(adapter: Any, store_url: str, capacity: int) -> None:
    """Export ``adapter``'s capacity, usage and evictions until it is closed or collected."""
    _COLLECTOR.track(adapter, store_url, capacity)


__all__ = ["track"]
