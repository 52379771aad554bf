"""The compactor's duties (the live node with the smallest id runs them; see docs/fleet.md).

- **Digest** (every round with news, at least every ``heartbeat_secs``): one object that says
  which snapshot is current and holds every chunk touched since it, the journal marks folded
  and the nodes seen. Every other node reads only this object per round (a conditional GET), so
  a node's coordination cost does not grow with the number of nodes.
- **Snapshot** (every ``compact_secs``, or sooner when the digest grows past
  :data:`DIGEST_MAX_ROWS`): the whole index; journals the previous snapshot held are deleted.
- **Reconcile** (every ``reconcile_secs``): the index against a full listing of the prefix.

A mixin of :class:`kvbucket.fleet.sync.Fleet`, split out to keep each file readable.
"""

from __future__ import annotations

import time
from typing import Any

from kvbucket.fleet.layout import Listing, digest_name, encode, is_fleet_name, snapshot_name
from kvbucket.fleet.view import Change

KEEP_SNAPSHOTS = 2
#: A snapshot is written early once this many chunks changed since the last one, so the
#: digest every node reads each round stays small (a row is ~40 bytes compressed).
DIGEST_MAX_ROWS = 20_000


class CompactorMixin:
    """Uses the state :class:`~kvbucket.fleet.sync.Fleet` defines (typed there)."""

    def _publish_digest(self: Any, listed_at: float, news: bool) -> None:
        """Write the digest when something changed since the last one, or to show liveness."""
        now = time.time()
        live = tuple(self.live_nodes())
        due = now - self._digest_written >= min(self.config.heartbeat_secs, self.config.node_timeout_secs / 3)
        if len(live) == 1 or not (news or due or live != self._digest_live):
            return  # alone, nobody reads it: a joining node lists, and is then seen here
        with self._lock:
            body = {"gen": self._snap[0], "snode": self._snap[1], "t": listed_at, "node": self.node,
                    "marks": dict(self._applied), "seen": {**self._seen, self.node: now},
                    **self._view.delta_body()}
        self._count("put")
        self._store.put(digest_name(self._prefix), encode("digest", body, level=6))
        self._digest_written, self._digest_live = now, live
        self._digest_tag = None  # ours: read it again only if another node overwrote it
        self.stats["digests_written"] += 1

    def _compact_due(self: Any, now: float) -> bool:
        return now - self._snap_time >= self.config.compact_secs or len(self._view.touched) > DIGEST_MAX_ROWS

    def _compact(self: Any, listing: Listing) -> None:
        self._flush()
        now = time.time()
        with self._lock:
            self._view.prune_tombs(now)
            gen = max(self._snap[0], max((g for g, *_ in listing.snapshots), default=-1)) + 1
            marks = dict(self._applied)
            body = {"gen": gen, "node": self.node, "t": now, "marks": marks, "reconciled": self._reconciled,
                    **self._view.to_body()}
            prev = dict(self._snap_marks)
            touched, self._view.touched = self._view.touched, set()
        self._count("put")
        try:
            self._store.put(snapshot_name(self._prefix, gen, self.node), encode("snapshot", body))
        except BaseException:
            with self._lock:
                self._view.touched |= touched  # the digest still needs them against the old snapshot
            raise
        self.stats["snapshots_written"] += 1
        with self._lock:
            # Journals this snapshot holds are forgotten one generation late, like their objects
            # below: nodes starting together each write a first snapshot, and the larger
            # (gen, node) wins, so this one may be replaced by one that lacks them; a node that
            # then loads it re-applies them (its own included) instead of losing those records.
            for n, js in self._pending.items():
                for seq in [s for s in js if s <= prev.get(n, 0)]:
                    del js[seq]
            self._prev_marks, self._snap_marks = prev, marks
            self._snap, self._snap_time = (gen, self.node), now
        # Journals are deleted one generation late: a node that has not loaded the new snapshot
        # yet still finds everything through the previous one.
        old = [name for n, js in listing.journals.items() for seq, name in js if seq <= prev.get(n, 0)]
        if old:
            self._count("delete", len(old), prepaid=True)  # paid by the journals' writers
        # Keep the newest good snapshot besides this one; older ones go, good or bad (the listing
        # is from before this one: a bad one at a higher generation goes at the next compaction).
        good = [(g, n) for g, n, name, _ in listing.snapshots if not self._quarantine.holds(name, None)]
        keep = sorted(good, reverse=True)[: KEEP_SNAPSHOTS - 1]
        snaps = [name for g, n, name, _ in listing.snapshots if keep and (g, n) < keep[-1]]
        if snaps:
            self._count("delete", len(snaps))
        if old or snaps:
            self._store.delete_many(old + snaps)

    def _reconcile(self: Any) -> list[Change]:
        """Compare the view with a full listing of the prefix; publish the differences.

        An indexed chunk the listing lacks is checked with a HEAD before it is dropped: a listing
        taken while other nodes write may miss an object, and dropping a live chunk from every
        node's index would make it look unused (then evicted as old when adopted again).
        """
        start = time.time()
        listed: dict[str, tuple[int, float]] = {}
        pages = 0
        where = f"{self._prefix}/" if self._prefix else ""
        for i, info in enumerate(self._chunks.list(where)):
            if i % 1000 == 0:
                pages += 1
            if is_fleet_name(info.name, self._prefix) or self._view.salt(info.name) is None:
                continue
            listed[info.name] = (info.size, info.mtime if info.mtime is not None else start)
        self._count("list", max(1, pages))
        settled = start - max(self.config.grace_secs, 2 * self.config.stage_secs)
        with self._lock:
            missing = [n for n, e in self._view.entries.items() if n not in listed and e.stored < settled]
        if missing:
            self._count("head", len(missing))
            gone = {r.name for r in self._chunks.head_many(missing) if r.ok and r.size is None}
        else:
            gone = set()
        changes: list[Change] = []
        with self._lock:
            for name, (size, mtime) in listed.items():
                if name not in self._view.entries:
                    rec = ("s", self._view.seg(name), size, min(mtime, start))
                    ch = self._view.apply(self.node, rec)
                    if ch is not None:
                        changes.append(ch)
                        self._buf.append(rec)
            for name in missing:
                if name in gone:
                    rec = ("d", self._view.seg(name), 0, start)
                    ch = self._view.apply(self.node, rec)
                    if ch is not None:
                        changes.append(ch)
                        self._buf.append(rec)
            self._reconciled = start
        self.stats["reconciles"] += 1
        return changes


__all__ = ["DIGEST_MAX_ROWS", "KEEP_SNAPSHOTS", "CompactorMixin"]
