"""One node's folded picture of the fleet, shared by the parts of :class:`~kvbucket.fleet.sync.Fleet`.

The node (:mod:`.sync`: what the host tells it, its journals), the reader (:mod:`.reader`: the
digest, snapshots and journals it folds in) and the compactor (:mod:`.compactor`) each own their
own bookkeeping and are handed this object for what they share: the view, the records not yet
published, the journal marks folded and the current snapshot. Everything here is guarded by
``lock``; no part calls out (to the store or the host) while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvbucket.fleet.layout import Record
from kvbucket.fleet.view import FleetView
from kvbucket.keys import ObjectKey


class Count(Protocol):
    """Counts coordination requests (``prepaid``: the journals' writers paid for them)."""

    def __call__(self, verb: str, n: int = 1, *, prepaid: bool = False) -> None: ...


STATS = ("journals_written", "journals_read", "digests_written", "digests_read", "digests_unchanged",
         "snapshots_written", "snapshots_read", "reconciles", "listing_rounds", "coordination_requests",
         "data_requests", "remote_stores_seen", "remote_deletes_seen", "evicted_own", "evicted_cross_node",
         "refused_chunks", "journal_gaps", "sync_errors")


@dataclass(slots=True)
class FleetState:
    prefix: str
    parse: Callable[[str], ObjectKey | None] | None
    view: FleetView
    lock: threading.Lock = field(default_factory=threading.Lock)
    buf: list[Record] = field(default_factory=list)  # this node's records not yet journaled
    accessed: dict[str, float] = field(default_factory=dict)  # deduplicated access hints, ditto
    applied: dict[str, int] = field(default_factory=dict)  # node -> newest journal seq folded
    #: node -> seq -> records: journals newer than the snapshot (re-applied on a newer one)
    pending: dict[str, dict[int, list[Record]]] = field(default_factory=dict)
    snap: tuple[int, str] = (-1, "")  # the current snapshot's (generation, node)
    snap_marks: dict[str, int] = field(default_factory=dict)
    prev_marks: dict[str, int] = field(default_factory=dict)
    snap_time: float = 0.0
    reconciled: float = 0.0
    #: Every node's access hints up to about this time are in the view (see Fleet._horizon).
    known_at: float = 0.0
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))

    def seen_change(self, ch: tuple[str, int | None]) -> None:
        """Count another node's store or delete learned (a change the host mirrors)."""
        self.stats["remote_stores_seen" if ch[1] is not None else "remote_deletes_seen"] += 1


__all__ = ["STATS", "Count", "FleetState"]
