"""A fleet member for a writer that keeps no index of its own: LMCache's non-MP connector and
the engine tiers (SGLang HiCache, vLLM's secondary tier, see :mod:`kvbucket.integrations.engine_fleet`).

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

from kvbucket.fleet import gauges
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.refusals import delete_as_seen

_UNSALTED = SimpleNamespace(cache_salt="")  # connector keys carry no cache_salt


def _as_key(salt: str | None) -> SimpleNamespace | None:
    """What :class:`~kvbucket.fleet.view.FleetView` reads of a parsed name: its ``cache_salt``."""
    return None if salt is None else SimpleNamespace(cache_salt=salt)


class StoreFleet:
    def __init__(
        self,
        fleet_store: ObjectStore,
        chunk_store: ObjectStore,
        config: FleetConfig,
        *,
        capacity: int,
        eviction: EvictionConfig,
        parse_key_string: Callable[[str], str | None] | None = None,
        parse_salt: Callable[[str], str | None] | None = None,
        on_gone: Callable[[list[str]], None] = lambda names: None,
    ) -> None:
        """``fleet_store`` holds the fleet's objects as they are; ``chunk_store`` is the view the
        writer stores chunks through (listings report payload sizes; eviction deletes there).

        Chunk names: ``parse_key_string`` (a chunk, counted unsalted) or ``parse_salt`` (the
        salt the name carries, the fleet's per-salt share and pin; None: not a chunk).
        ``on_gone`` hears of chunks deleted anywhere in the fleet (on the fleet thread), so a
        writer that remembers what is stored forgets them."""
        if (parse_key_string is None) == (parse_salt is None):
            raise ValueError("StoreFleet needs exactly one of parse_key_string and parse_salt")
        if parse_key_string is not None:
            keyed = parse_key_string

            def parse(name: str) -> SimpleNamespace | None:
                return _UNSALTED if keyed(name) is not None else None
        else:
            salt_of = parse_salt

            def parse(name: str) -> SimpleNamespace | None:
                return _as_key(salt_of(name))  # type: ignore[misc]

        self._chunks = chunk_store
        self._on_gone = on_gone
        self.fleet = Fleet(
            fleet_store,
            config,
            chunk_store=chunk_store,
            capacity=capacity,
            eviction=eviction,
            parse=parse,  # type: ignore[arg-type]
            on_changes=self._changed,
            on_tick=self._evict,
        )
        self.fleet.start()
        gauges.track(self.fleet, chunk_store.url, capacity)  # kvbucket stats shows its usage

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
        gauges.forget(self.fleet)
        self.fleet.close()

    def _evict(self) -> None:
        """On the fleet thread after each round: delete this node's share of the victims."""
        victims = self.fleet.victims(())
        if not victims:
            return
        # By the version a HEAD sees now: a rewrite from then on is kept (docs/integrity.md).
        done = delete_as_seen(self._chunks, victims, {}, "fleet_eviction")
        gone = [n for n in victims if (r := done.get(n)) is not None and r.ok
                and getattr(r, "removed", True) and not getattr(r, "changed", False)]
        if changed := [n for n in victims if getattr(done.get(n), "changed", False)]:
            # Written since: recent now (the view's entry is stale), judged anew later.
            sizes = self.fleet.sizes(changed)
            self.fleet.note_stored(list(sizes), list(sizes.values()))
        self.fleet.note_deleted(gone, evicted=True)
        if gone:
            self._on_gone(gone)

    def _changed(self, changes: list[tuple[str, int | None]]) -> None:
        gone = [name for name, size in changes if size is None]
        if gone:
            self._on_gone(gone)


__all__ = ["StoreFleet"]
