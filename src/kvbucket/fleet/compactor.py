"""The compactor's duties (the live node with the smallest id runs them; see docs/fleet.md).

- **Digest** (every round with news, at least every ``heartbeat_secs``): one object that says
  which snapshot is current and holds every chunk touched since it, the journal marks folded
  and the nodes seen. Every other node reads only this object per round (a conditional GET), so
  a node's coordination cost does not grow with the number of nodes.
- **Snapshot** (every ``compact_secs``, or sooner when the digest grows past
  :data:`DIGEST_MAX_ROWS`): the whole index; journals the previous snapshot held are deleted.
- **Reconcile** (every ``reconcile_secs``): the index against a full listing of the prefix.

A part of :class:`kvbucket.fleet.sync.Fleet` that owns its own bookkeeping (when it last wrote
the digest, and for which live nodes) and is handed the rest: the node's shared state
(:mod:`.state`), its peers (liveness, capacities), the quarantine and a request counter.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import Listing, digest_name, encode, is_fleet_name, snapshot_name
from kvbucket.fleet.peers import Liveness, Peers
from kvbucket.fleet.quarantine import Quarantine
from kvbucket.fleet.state import Count, FleetState
from kvbucket.fleet.view import Change
from kvbucket.stores.base import ObjectStore

KEEP_SNAPSHOTS = 2
#: A snapshot is written early once this many chunks changed since the last one, so the
#: digest every node reads each round stays small (a row is ~40 bytes compressed).
DIGEST_MAX_ROWS = 20_000


class Compactor:
    def __init__(self, node: str, store: ObjectStore, chunks: ObjectStore, config: FleetConfig,
                 state: FleetState, *, liveness: Liveness, peers: Peers, quarantine: Quarantine,
                 count: Count, flush: Callable[[], object]) -> None:
        """``chunks``: the view of the chunks (listings report payload sizes); ``flush``
        journals the node's buffered records (a snapshot holds them)."""
        self.node, self.config = node, config
        self._store, self._chunks, self._state, self._count, self._flush = store, chunks, state, count, flush
        self._liveness, self._peers, self._quarantine = liveness, peers, quarantine
        self._digest_written = 0.0
        self._digest_live: tuple[str, ...] = ()

    def publish_digest(self, listed_at: float, news: bool) -> bool:
        """Write the digest when something changed since the last one, or to show liveness."""
        st, now = self._state, time.time()
        live = tuple(self._liveness.live())
        due = now - self._digest_written >= min(self.config.heartbeat_secs, self.config.node_timeout_secs / 3)
        if len(live) == 1 or not (news or due or live != self._digest_live):
            return False  # alone, nobody reads it: a joining node lists, and is then seen here
        ages = self._liveness.ages()
        with st.lock:
            # "ages" (durations on this node's clock) decide liveness; "seen" is for older readers.
            body = {"gen": st.snap[0], "snode": st.snap[1], "t": listed_at, "w": now, "node": self.node,
                    "marks": dict(st.applied), "ages": ages, "seen": {n: now - a for n, a in ages.items()},
                    "caps": dict(self._peers.caps), **st.view.delta_body()}
        self._count("put")
        self._store.put(digest_name(st.prefix), encode("digest", body, level=6))
        self._digest_written, self._digest_live = now, live
        st.stats["digests_written"] += 1
        return True

    def compact_due(self, now: float) -> bool:
        st = self._state
        return now - st.snap_time >= self.config.compact_secs or len(st.view.touched) > DIGEST_MAX_ROWS

    def compact(self, listing: Listing) -> None:
        st = self._state
        self._flush()
        now = time.time()
        with st.lock:
            st.view.prune_tombs(now)
            gen = max(st.snap[0], max((g for g, *_ in listing.snapshots), default=-1)) + 1
            marks = dict(st.applied)
            body = {"gen": gen, "node": self.node, "t": now, "marks": marks, "reconciled": st.reconciled,
                    **st.view.to_body()}
            prev = dict(st.snap_marks)
            touched, st.view.touched = st.view.touched, set()
        self._count("put")
        try:
            self._store.put(snapshot_name(st.prefix, gen, self.node), encode("snapshot", body))
        except BaseException:
            with st.lock:
                st.view.touched |= touched  # the digest still needs them against the old snapshot
            raise
        st.stats["snapshots_written"] += 1
        with st.lock:
            # Journals this snapshot holds are forgotten one generation late, like their objects
            # below: nodes starting together each write a first snapshot, and the larger
            # (gen, node) wins, so this one may be replaced by one that lacks them; a node that
            # then loads it re-applies them (its own included) instead of losing those records.
            for n, js in st.pending.items():
                for seq in [s for s in js if s <= prev.get(n, 0)]:
                    del js[seq]
            st.prev_marks, st.snap_marks = prev, marks
            st.snap, st.snap_time = (gen, self.node), now
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

    def reconcile(self) -> list[Change]:
        """Compare the view with a full listing of the prefix; publish the differences.

        An indexed chunk the listing lacks is checked with a HEAD before it is dropped: a listing
        taken while other nodes write may miss an object, and dropping a live chunk from every
        node's index would make it look unused (then evicted as old when adopted again).
        """
        st, start = self._state, time.time()
        listed: dict[str, tuple[int, float]] = {}
        pages = 0
        where = f"{st.prefix}/" if st.prefix else ""
        for i, info in enumerate(self._chunks.list(where)):
            if i % 1000 == 0:
                pages += 1
            if is_fleet_name(info.name, st.prefix) or st.view.salt(info.name) is None:
                continue
            listed[info.name] = (info.size, info.mtime if info.mtime is not None else start)
        self._count("list", max(1, pages))
        settled = start - max(self.config.grace_secs, 2 * self.config.stage_secs)
        with st.lock:
            missing = [n for n, e in st.view.entries.items() if n not in listed and e.stored < settled]
        if missing:
            self._count("head", len(missing))
            gone = {r.name for r in self._chunks.head_many(missing) if r.ok and r.size is None}
        else:
            gone = set()
        changes: list[Change] = []
        with st.lock:
            for name, (size, mtime) in listed.items():
                if name not in st.view.entries:
                    rec = ("s", st.view.seg(name), size, min(mtime, start))
                    ch = st.view.apply(self.node, rec)
                    if ch is not None:
                        changes.append(ch)
                        st.buf.append(rec)
            for name in missing:
                if name in gone:
                    rec = ("d", st.view.seg(name), 0, start)
                    ch = st.view.apply(self.node, rec)
                    if ch is not None:
                        changes.append(ch)
                        st.buf.append(rec)
            st.reconciled = start
        st.stats["reconciles"] += 1
        return changes


__all__ = ["DIGEST_MAX_ROWS", "KEEP_SNAPSHOTS", "Compactor"]
