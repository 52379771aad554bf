"""A fleet member for a writer that keeps no index of its own: LMCache's non-MP connector.

The L2 adapter mirrors the fleet into its index (:mod:`.host`); the connector answers lookups
with HEADs and has nothing to mirror into, so it only tells the fleet what it stored, loaded
and removed, asks it whether a store fits under the write cap, and after every sync round
deletes its share of the fleet-wide victims. Capacity, eviction, TTL and pins then hold
across connectors and L2 adapters on one prefix alike (docs/fleet.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.base import ObjectStore

_UNSALTED = SimpleNamespace(cache_salt="")  # connector keys carry no cache_salt


class StoreFleet:
    def __init__(
        self,
        fleet_store: ObjectStore,
        chunk_store: ObjectStore,
        config: FleetConfig,
        *,
        capacity: int,
        eviction: EvictionConfig,
        parse_key_string: Callable[[str], str | None],
    ) -> None:
        """``fleet_store`` holds the fleet's objects as they are; ``chunk_store`` is the view the
        writer stores chunks through (listings report payload sizes; eviction deletes there)."""
        self._chunks = chunk_store
        self.fleet = Fleet(
            fleet_store,
            config,
            chunk_store=chunk_store,
            capacity=capacity,
            eviction=eviction,
            parse=lambda name: _UNSALTED if parse_key_string(name) is not None else None,  # type: ignore[arg-type,return-value]
            on_tick=self._evict,
        )
        self.fleet.start()

    def admit(self, sizes: list[int]) -> int:
        return self.fleet.admit(sizes)

    def stored(self, names: Iterable[str], sizes: Iterable[int]) -> None:
        self.fleet.note_stored(names, sizes)

    def accessed(self, names: Iterable[str]) -> None:
        self.fleet.note_accessed(names)

    def deleted(self, names: Iterable[str]) -> None:
        self.fleet.note_deleted(names)

    def status(self) -> dict[str, Any]:
        return self.fleet.status()

    def close(self) -> None:
        self.fleet.close()

    def _evict(self) -> None:
        """On the fleet thread after each round: delete this node's share of the victims."""
        victims = self.fleet.victims(())
        if not victims:
            return
        gone = [r.name for r in self._chunks.delete_many(victims) if r.ok]
        self.fleet.note_deleted(gone, evicted=True)


__all__ = ["StoreFleet"]
