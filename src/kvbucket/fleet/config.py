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

    #: Every ``sync_secs`` a node writes its journal (if it has news) and reads the digest;
    #: a chunk stored on one node is a hit on every other within about ``3 * sync_secs``.
    #: With ``coordination_ratio``: the shortest time between two rounds of a node.
    sync_secs: float = Field(5.0, gt=0.0, le=3600.0)
    #: Pace rounds by the node's own data requests instead of the clock: coordination requests
    #: stay at most this fraction of data requests (chunk stores and loads) once a node is busy,
    #: and a chunk stored anywhere is a hit on every node in use within ``max_sync_secs``.
    #: None: clock-driven (a round every ``sync_secs``).
    coordination_ratio: float | None = Field(None, gt=0.0, le=1.0)
    #: With ``coordination_ratio``: the visibility bound. A node in use waits at most a quarter
    #: of it between rounds (publish, compactor, poll, and a quarter for their requests).
    #: None: 60.
    max_sync_secs: float | None = Field(None, gt=0.0, le=3600.0)
    #: A node that had nothing to publish and found the digest unchanged (with
    #: ``coordination_ratio``: that served no request) doubles its interval up to this (None:
    #: 6 * sync_secs; with ``coordination_ratio``, ``max_sync_secs``); its own next store or
    #: load brings it back.
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
    #: writes it cannot see yet). The default leaves a capacity of headroom so that eviction,
    #: not refusal, makes room for a burst (the newest chunks are kept, as LRU users expect);
    #: refusal only bounds a burst far past capacity. None: never refuse.
    write_cap: float | None = Field(2.0, gt=0.0)
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
        if self.coordination_ratio is None:
            if self.max_sync_secs is not None:
                raise ValueError("max_sync_secs applies only with coordination_ratio (clock-driven "
                                 "rounds make a chunk visible within about 3 * sync_secs)")
            return self
        bound = self.visibility_secs
        if bound < 4 * self.sync_secs:
            raise ValueError(f"max_sync_secs ({bound:g}) must be at least 4 * sync_secs "
                             f"({4 * self.sync_secs:g}): a publish, a compactor round and a poll each "
                             "wait up to a quarter of it, and sync_secs is the shortest wait")
        if self.idle_sync_secs is not None and self.idle_sync_secs < self.stage_secs:
            raise ValueError(f"idle_sync_secs must be at least max_sync_secs / 4 ({self.stage_secs:g}) "
                             "with coordination_ratio (a node in use waits that long)")
        if self.idle_secs > self.node_timeout_secs * 2 / 3:
            what = "idle_sync_secs" if self.idle_sync_secs is not None else "max_sync_secs"
            raise ValueError(f"{what} ({self.idle_secs:g}) must be at most 2/3 of node_timeout_secs "
                             f"({self.node_timeout_secs:g}) with coordination_ratio: an idle node "
                             "rounds (and shows it is alive) that seldom")
        return self

    @property
    def visibility_secs(self) -> float:
        """The bound on a chunk's invisibility on nodes in use: ``max_sync_secs`` (default 60)
        with ``coordination_ratio``, else about three rounds."""
        if self.coordination_ratio is None:
            return 3 * self.sync_secs
        return self.max_sync_secs if self.max_sync_secs is not None else 60.0

    @property
    def stage_secs(self) -> float:
        """The longest wait between two rounds of a node in use (publish, fold, poll: each)."""
        return self.sync_secs if self.coordination_ratio is None else self.visibility_secs / 4

    @property
    def idle_secs(self) -> float:
        if self.idle_sync_secs is not None:
            return self.idle_sync_secs
        return 6 * self.sync_secs if self.coordination_ratio is None else self.visibility_secs


__all__ = ["FleetConfig"]
