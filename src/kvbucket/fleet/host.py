"""How a chunk tier (the L2 adapter) takes part in a fleet, through a narrow interface.

The tier tells :class:`FleetLink` what it stored, accessed and deleted, and asks it for eviction
victims; the link hands what the other nodes did to ``on_changes`` (the tier mirrors it into its
index, so usage and lookups see the whole fleet), calls ``on_tick`` after every sync round (the
tier's eviction) and ``on_ready`` once the fleet's view is complete. The link knows nothing of
the tier beyond these callbacks, so this module imports nothing of :mod:`kvbucket.l2`.

Lock order: the tier's lock may be held while calling into the fleet (which takes its own lock);
the fleet never calls back while holding its lock, so the two cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from kvbucket.fleet import gauges
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.fleet.view import Change
from kvbucket.keys import ObjectKey
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.base import ObjectStore


class FleetLink:
    def __init__(
        self,
        chunk_store: ObjectStore,
        config: FleetConfig,
        *,
        parse: Callable[[str], ObjectKey | None],
        prefix: str,
        capacity: int,
        eviction: EvictionConfig | None,
        on_changes: Callable[[list[Change]], None],
        on_tick: Callable[[], None],
        on_ready: Callable[[], None],
    ) -> None:
        """``chunk_store``: the tier's (sealed) store; fleet objects go to the store it wraps.
        Call :meth:`start` once the tier can take the callbacks."""
        self._url = chunk_store.url
        self._capacity = capacity
        self.fleet = Fleet(
            getattr(chunk_store, "inner", chunk_store),  # chunks are sealed; fleet objects are not
            config,
            chunk_store=chunk_store,
            parse=parse,
            prefix=prefix,
            capacity=capacity,
            eviction=eviction,
            on_changes=on_changes,
            on_tick=on_tick,
            on_ready=on_ready,
        )

    def start(self) -> None:
        self.fleet.start()
        gauges.track(self.fleet, self._url, self._capacity)  # kvbucket stats shows its usage

    # ---- tier -> fleet -----------------------------------------------------------------
    def stored(self, names: Iterable[str], sizes: Iterable[int]) -> None:
        self.fleet.note_stored(names, sizes)

    def accessed(self, names: Iterable[str]) -> None:
        self.fleet.note_accessed(names)

    def deleted(self, names: Iterable[str], *, evicted: bool = False) -> None:
        self.fleet.note_deleted(names, evicted=evicted)

    def admit(self, sizes: list[int]) -> int:
        return self.fleet.admit(sizes)

    def victims(self, busy: Container[str]) -> list[str]:
        return self.fleet.victims(busy)

    def has_expired(self) -> bool:
        return self.fleet.has_expired()

    def status(self) -> dict[str, Any]:
        return self.fleet.status()

    def close(self) -> None:
        gauges.forget(self.fleet)
        self.fleet.close()


__all__ = ["FleetLink"]
