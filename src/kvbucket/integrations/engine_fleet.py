"""Fleet settings of the engine tiers: SGLang HiCache workers and vLLM secondary tiers on one store
share one capacity, fleet-wide eviction, ``max_age_secs`` and pins (docs/fleet.md).

Neither tier keeps an index of its own (lookups are HEADs or listings), so each takes part like
LMCache's non-MP connector, through :class:`kvbucket.fleet.member.StoreFleet`: it asks the fleet
before a store (a refused page or chunk is a failed store, like a full disk), tells it what it
stored, loaded and removed, and deletes its share of the fleet-wide victims after each round.

Both tiers name objects ``<prefix>/<model>/<salt>/...`` (:mod:`.naming`), the salt segment
being ``nosalt`` or ``salt-<digest>``. :func:`chunk_salt` reads either engine's names, so SGLang
and vLLM tiers sharing one store (and so one fleet) count the same objects: every member of a
fleet must, or victims that another member owns are never deleted. The salt digest is the
fleet's salt (its per-salt fair shares need only tell salts apart); pinned salts are given in
clear and pinned as both engines' digests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, model_validator

from kvbucket.fleet.config import FleetConfig
from kvbucket.integrations.naming import chunk_salt, salt_segment
from kvbucket.l2.config import GIB
from kvbucket.l2.eviction import EvictionConfig

if TYPE_CHECKING:
    from kvbucket.fleet.member import StoreFleet
    from kvbucket.stores.base import ObjectStore

ENGINES = ("sglang", "vllm")
REFUSED = ("not stored: the store is at its fleet write cap (max_capacity_gb * fleet.write_cap; "
           "eviction makes room within a few sync rounds)")


class FleetSettings(BaseModel):
    """The connector's fleet keys (``fleet``, ``max_capacity_gb``, ``eviction``) for a tier."""

    fleet: FleetConfig | None = Field(
        None, description="join the store's fleet: every node on the store counts its whole capacity")
    max_capacity_gb: float = Field(0.0, ge=0.0, description="the capacity the whole fleet shares (0: none)")
    eviction: EvictionConfig | None = Field(None, description="LRU watermarks of the fleet-wide eviction")

    @model_validator(mode="after")
    def _needs_fleet(self) -> FleetSettings:
        if self.fleet is None and (self.max_capacity_gb or self.eviction is not None):
            raise ValueError(
                "max_capacity_gb and eviction need a \"fleet\" object: the tier keeps no index of its "
                "own; the fleet counts the whole store (e.g. \"fleet\": {} for the defaults)")
        return self


def pinned_segments(salts: Iterable[str]) -> tuple[str, ...]:
    """Pinned salts as the names carry them (each engine hashes a salt in its own domain)."""
    return tuple(sorted({salt_segment(s, e) if s else "" for s in salts for e in ENGINES}))


def open_fleet(settings: FleetSettings, raw: ObjectStore, chunks: ObjectStore,
               on_gone: Callable[[list[str]], None]) -> StoreFleet | None:
    """The tier's fleet membership (None without ``fleet``). ``raw`` holds the fleet's objects,
    ``chunks`` is the (sealed) view the tier stores through; ``on_gone`` hears of deleted chunks."""
    if settings.fleet is None:
        return None
    from kvbucket.fleet.member import StoreFleet

    cfg = settings.fleet.model_copy(update={"pinned_salts": pinned_segments(settings.fleet.pinned_salts)})
    return StoreFleet(raw, chunks, cfg, capacity=int(settings.max_capacity_gb * GIB),
                      eviction=settings.eviction or EvictionConfig(), parse_salt=chunk_salt, on_gone=on_gone)


__all__ = ["REFUSED", "FleetSettings", "chunk_salt", "open_fleet", "pinned_segments"]
