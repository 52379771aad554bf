"""``"fleet": {...}`` in an L2 adapter spec: share one prefix's capacity between many nodes.

Parsed strictly like the rest of the spec (see :mod:`kvbucket.l2.config`). Times are seconds.
The protocol these settings tune is described in docs/fleet.md.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_NODE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FleetConfig(BaseModel):
    """How often a node publishes and reads the fleet's shared state, and what eviction spares."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    #: Every ``sync_secs`` a node writes its journal (if it has news) and reads the others';
    #: a chunk stored on one node is a hit on every other within about ``2 * sync_secs``.
    sync_secs: float = Field(5.0, gt=0.0, le=3600.0)
    #: A node that had nothing to publish and found the digest unchanged doubles its interval
    #: up to this (None: 6 * sync_secs); its own next store brings it back to ``sync_secs``.
    idle_sync_secs: float | None = Field(None, gt=0.0)
    #: A node rewrites its heartbeat object this often; a node unseen for ``node_timeout_secs``
    #: is dead (its share of eviction goes to the living).
    heartbeat_secs: float = Field(30.0, gt=0.0)
    node_timeout_secs: float = Field(90.0, gt=0.0)
    #: The compactor (the live node with the smallest id) folds journals into a snapshot this often.
    compact_secs: float = Field(60.0, gt=0.0)
    #: ... and compares the index with a full listing this often (repairs what dead nodes left).
    reconcile_secs: float = Field(600.0, gt=0.0)
    #: Chunks stored or accessed (anywhere in the fleet, as far as known) this recently are
    #: never evicted: another node may be loading them.
    grace_secs: float = Field(10.0, ge=0.0)
    #: Chunks stored longer ago than this are evicted by any node (None: no age limit).
    max_age_secs: float | None = Field(None, gt=0.0)
    #: A node refuses new chunks (a failed store, like a full disk) once they would push the
    #: fleet's known usage past ``write_cap * capacity``; each node may fill its part of the
    #: headroom it saw at its last round (1/N alone; 1/(3N-2) with N live nodes, whose latest
    #: writes it cannot see yet). None: never refuse (eviction alone bounds usage).
    write_cap: float | None = Field(1.0, gt=0.0)
    #: ``cache_salt`` values eviction never touches (their bytes still count). A JSON list.
    pinned_salts: tuple[str, ...] = Field((), strict=False)
    #: This node's id in the fleet (default: random). Letters, digits, ``_`` and ``-``.
    node_id: str | None = None

    @field_validator("node_id")
    @classmethod
    def _node(cls, v: str | None) -> str | None:
        if v is not None and not _NODE_RE.match(v):
            raise ValueError("node_id must be 1-64 letters, digits, '_' or '-'")
        return v

    @model_validator(mode="after")
    def _check(self) -> FleetConfig:
        if self.node_timeout_secs <= self.heartbeat_secs:
            raise ValueError("node_timeout_secs must exceed heartbeat_secs (a live node would look dead)")
        if self.idle_sync_secs is not None and self.idle_sync_secs < self.sync_secs:
            raise ValueError("idle_sync_secs must be at least sync_secs")
        return self

    @property
    def idle_secs(self) -> float:
        return self.idle_sync_secs if self.idle_sync_secs is not None else 6 * self.sync_secs


__all__ = ["FleetConfig"]
