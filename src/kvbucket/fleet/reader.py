"""How a node folds in what the others did: the digest, a snapshot, the journals.

Everything read here comes from ``_fleet/`` and is untrusted (:mod:`.wire`): an object that does
not parse, or is too big, is quarantined (:mod:`.quarantine`) and skipped, never applied in part,
and never stops the round; a bad snapshot, at whatever generation, shadows no good one. Owns the
digest's bookkeeping (the version last read, which node wrote it, when it was asked for); is
handed the node's shared state (:mod:`.state`), its peers (:mod:`.peers`) and a request counter.
"""

from __future__ import annotations

import time
from collections.abc import Set

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import Journal, Listing, digest_name, snapshot_name
from kvbucket.fleet.peers import Liveness, Peers
from kvbucket.fleet.quarantine import Quarantine
from kvbucket.fleet.state import Count, FleetState
from kvbucket.fleet.view import Change, FleetView
from kvbucket.fleet.wire import MAX_STORED, BadObject, read_digest, read_snapshot
from kvbucket.stores.base import ObjectStore


class Reader:
    def __init__(self, node: str, store: ObjectStore, config: FleetConfig, state: FleetState, *,
                 liveness: Liveness, peers: Peers, quarantine: Quarantine, count: Count) -> None:
        self.node, self.config = node, config
        self._store, self._state, self._count = store, state, count
        self._liveness, self._peers, self._quarantine = liveness, peers, quarantine
        self.tag: str | None = None  # the digest's version last read (None: read it in full)
        self.t = 0.0  # the compactor's listing time the digest holds (its clock: for the horizon)
        self.writer = ""  # the node that wrote the digest last read
        self._asked: float | None = None  # this node's clock at the previous digest request

    def read_digest(self, *, once: bool = False) -> tuple[list[Change], bool] | None:
        """The compactor's digest through one conditional GET: (changes, whether they are news),
        or None when there is none, it does not parse, or its writer made no progress for
        ``node_timeout_secs`` on this node's clock (then this round takes the listing path).

        ``once``: a single look from outside the fleet (``kvbucket du``), with no history to
        judge by: a digest written longer than ``node_timeout_secs`` ago by this machine's
        clock is stale (a dead fleet's), and ages count from its writing. Only for display."""
        st, started = self._state, time.time()
        asked = self._asked if self.tag is not None else None  # None: a full read, maybe of an old one
        self._asked = started
        self._count("get")
        name = digest_name(st.prefix)
        rev = self._store.get_if_changed(name, self.tag)
        if rev.tag is None:
            return None
        if rev.data is None:
            age = self._liveness.age(self.writer)
            if age is None or age > self.config.node_timeout_secs or self._quarantine.holds(name, rev.tag):
                return None
            st.stats["digests_unchanged"] += 1
            # Unchanged: the compactor, listing every stage, found no new journal meanwhile.
            st.known_at = max(st.known_at, self.t, started - 2 * self.config.stage_secs)
            return [], False
        try:
            body = read_digest(rev.data)
        except BadObject as e:  # list this round; ask again only once it changed (no body till then)
            self._quarantine.judge(name, rev.tag, e)
            self.tag = rev.tag
            return None
        self.tag, self.t, self.writer = rev.tag, body["t"], body["node"]
        # A digest that changed is its writer's progress; its ages are the others' (its clock's
        # durations, not its timestamps). Older writers send only timestamps ("seen").
        ages = body["ages"] or {n: max(0.0, started - t) for n, t in body["seen"].items()}
        if once:
            written = max(0.0, started - body.get("w", self.t))
            if written > self.config.node_timeout_secs:
                return None
            ages = {n: a + written for n, a in ages.items()}
        else:
            self._liveness.saw(self.writer)
        self._liveness.observe_ages(ages)
        if "w" in body:
            self._peers.clock_of(self.writer, body["w"], asked, time.time())
        for n, cap in body["caps"].items():
            self._peers.capacity_of(n, cap)
        changes: list[Change] = []
        gen, snode = body["gen"], body["snode"]
        if gen >= 0 and (gen, snode) > st.snap:
            loaded = self.load_snapshot(gen, snode, snapshot_name(st.prefix, gen, snode))
            if loaded is None:
                self.tag = None
                return None  # replaced since (or bad): list this round, read the next digest
            changes += loaded
        with st.lock:
            for ch in st.view.apply_delta(body):
                changes.append(ch)
                st.seen_change(ch)
            for n, seq in body["marks"].items():
                st.applied[n] = max(st.applied.get(n, 0), seq)
        st.known_at = max(st.known_at, self.t)
        st.stats["digests_read"] += 1
        return changes, bool(changes)  # a digest rewritten only to show the compactor alive is no news

    def fold(self, listing: Listing, fresh: Set[str] = frozenset(),
             since: float | None = None) -> list[Change]:
        """The newest good snapshot newer than the view, then every journal not folded yet.
        ``fresh``: journals written since the previous listing, which started at ``since`` on
        this node's clock (their writers' clocks are compared with it)."""
        st = self._state
        changes: list[Change] = []
        # The newest snapshot that parses: a bad one (even at a high generation) shadows nothing.
        for gen, node, name, size in sorted(listing.snapshots, reverse=True):
            if (gen, node) <= st.snap:
                break
            if self._quarantine.holds(name, None) or self._too_big("snapshot", name, size):
                continue
            loaded = self.load_snapshot(gen, node, name)
            if loaded is not None:
                changes += loaded
                break
        todo: list[tuple[str, int, str]] = []
        with st.lock:
            for node, js in listing.journals.items():
                if node == self.node:
                    continue
                done = st.applied.get(node, 0)
                todo += [(node, seq, name) for seq, name in sorted(js) if seq > done]
        todo = [(node, seq, name) for node, seq, name in todo
                if not self._quarantine.holds(name, listing.sizes.get(name))
                and not self._too_big("journal", name, listing.sizes.get(name, 0))]
        if not todo:
            return changes
        self._count("get", len(todo), prepaid=True)
        results = self._store.get_many([name for _, _, name in todo])
        now = time.time()
        journals: list[tuple[str, int, Journal]] = []
        for (node, seq, name), r in zip(todo, results, strict=True):
            if r.data is None:
                if r.error is None:
                    continue  # compacted away since the listing: the next snapshot has it
                raise r.error
            try:
                journal = Journal.from_bytes(bytes(r.data))
            except BadObject as e:  # skipped, not applied: the node's later journals still are
                self._quarantine.judge(name, len(r.data), e)
                continue
            journals.append((node, seq, journal))
            if journal.cap is not None:
                self._peers.capacity_of(node, journal.cap)
            if journal.t is not None and name in fresh:
                self._peers.clock_of(node, journal.t, since, now)
        with st.lock:
            for node, seq, journal in journals:
                if seq > st.applied.get(node, 0) + 1:
                    st.stats["journal_gaps"] += 1
                st.applied[node] = max(st.applied.get(node, 0), seq)
                st.pending.setdefault(node, {})[seq] = journal.records
                for ch in st.view.apply_all(node, journal.records):
                    changes.append(ch)
                    st.seen_change(ch)
                st.stats["journals_read"] += 1
        return changes

    def _too_big(self, kind: str, name: str, size: int | None) -> bool:
        """Too big to be a fleet object of ``kind`` by its listed size: quarantined unread."""
        if size is None or size <= MAX_STORED[kind]:
            return False
        self._quarantine.judge(name, size, f"{size} bytes, more than a fleet {kind} may hold")
        return True

    def load_snapshot(self, gen: int, node: str, name: str) -> list[Change] | None:
        """Replace the view with a snapshot plus what is newer than it; None when it is gone or
        does not parse (then it is quarantined)."""
        st = self._state
        if self._quarantine.holds(name, None):
            return None
        self._count("get")
        data = self._store.get(name)
        if data is None:
            return None  # replaced since the listing; the next round sees the newer one
        try:
            body = read_snapshot(data)
        except BadObject as e:
            self._quarantine.judge(name, len(data), e)
            return None
        view = FleetView.from_body(body, st.prefix, st.parse)
        marks = body["marks"]
        with st.lock:
            for n, js in st.pending.items():
                for seq in sorted(js):
                    if seq > marks.get(n, 0):
                        view.apply_all(n, js[seq])
                    else:
                        del js[seq]
            for rec in st.buf:
                view.apply(self.node, rec)
            for n, t in st.accessed.items():
                if n in view.entries:
                    view.entries[n].accessed = max(view.entries[n].accessed, t)
            # Keep the freshest access time either side knows (hints are not all journaled yet).
            for n, e in st.view.entries.items():
                mine = view.entries.get(n)
                if mine is not None and e.accessed > mine.accessed:
                    mine.accessed = e.accessed
            changes = view.diff(st.view)
            for ch in changes:  # other nodes' stores and deletes, learned through the snapshot
                st.seen_change(ch)
            st.view = view
            for n, seq in marks.items():
                st.applied[n] = max(st.applied.get(n, 0), seq)
            st.prev_marks, st.snap_marks = st.snap_marks, marks
            st.snap = (gen, node)
            st.snap_time = body["t"]
            st.reconciled = max(st.reconciled, body["reconciled"])
        st.stats["snapshots_read"] += 1
        return changes


__all__ = ["Reader"]
