"""One node's side of the fleet protocol: publish what it did, fold in what the others did.

A :class:`Fleet` runs one daemon thread. Every round (when :mod:`.pacing` says: by the clock or
by the node's own data requests) it

1. writes the node's buffered records (stores, deletes, accesses) as ONE journal object, if any;
2. on most nodes: reads the digest ``_fleet/d`` with one conditional GET (unchanged: no body)
   and, when the digest names a newer snapshot, that snapshot;
3. on the compactor (the live node with the smallest id, :mod:`.compactor`): lists ``_fleet/``,
   reads the new journals, writes the digest, and now and then a snapshot and a reconcile;
4. rewrites its heartbeat when it wrote no journal for ``heartbeat_secs``;
5. hands the changes to its host (the L2 adapter), refreshes its write budget and lets the
   host run an eviction pass.

A node falls back to the compactor's path (listing and journals) while there is no digest or
the digest is older than ``node_timeout_secs`` (the compactor died); the smallest live id then
takes over. Nothing here is on the inference path: lookups, loads and stores only append to a
buffer. See docs/fleet.md for the protocol, its costs and its failure cases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Container, Iterable
from typing import Any

from prometheus_client import Counter

from kvbucket.fleet.compactor import CompactorMixin
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import (
    Journal,
    Listing,
    Record,
    digest_name,
    heartbeat_name,
    journal_name,
    list_fleet,
    snapshot_name,
)
from kvbucket.fleet.pacing import Pacer
from kvbucket.fleet.quarantine import Quarantine
from kvbucket.fleet.view import Change, FleetView
from kvbucket.fleet.wire import JOURNAL_MAX_RECORDS, MAX_STORED, BadObject, read_digest, read_snapshot
from kvbucket.keys import ObjectKey
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.base import ObjectStore

log = logging.getLogger(__name__)

FLEET_EVICTIONS = Counter(
    "kvbucket_fleet_evictions",
    "Chunks this node evicted from a shared prefix, by who wrote them (self/other node).",
    ["writer"],
)
FLEET_REQUESTS = Counter(
    "kvbucket_fleet_requests", "Store requests spent on fleet coordination, by verb.", ["verb"]
)

#: How many rounds another node's writes take to reach this node's view (see _refresh_budget).
WRITE_LAG_ROUNDS = 3


class Fleet(CompactorMixin):
    """See the module docstring. ``on_changes`` is called from the fleet thread."""

    def __init__(
        self,
        store: ObjectStore,
        config: FleetConfig,
        *,
        prefix: str = "",
        capacity: int = 0,
        eviction: EvictionConfig | None = None,
        on_changes: Callable[[list[Change]], None] = lambda changes: None,
        on_tick: Callable[[], None] = lambda: None,
        on_ready: Callable[[], None] = lambda: None,
        chunk_store: ObjectStore | None = None,
        parse: Callable[[str], ObjectKey | None] | None = None,
    ) -> None:
        """``store`` holds the fleet's own objects (written as they are, so ``kvbucket du`` reads
        them with any store); ``chunk_store`` is the view of the chunks whose listing reports
        their payload sizes (the adapter's sealed store), default ``store``."""
        self.config = config
        self.node = config.node_id or secrets.token_hex(6)
        self._store = store
        self._chunks = chunk_store or store
        self._prefix = prefix
        self._capacity = capacity
        self._eviction = eviction or EvictionConfig(eviction_policy="noop")
        self._pinned = frozenset(config.pinned_salts)
        self._on_changes = on_changes
        self._on_tick = on_tick
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._parse = parse
        self._view = FleetView(prefix, parse)
        self._buf: list[Record] = []
        self._accessed: dict[str, float] = {}  # deduplicated access hints since the last journal
        self._seq = 0
        self._applied: dict[str, int] = {}
        self._pending: dict[str, dict[int, list[Record]]] = {}  # journals newer than the snapshot
        self._snap: tuple[int, str] = (-1, "")
        self._snap_marks: dict[str, int] = {}
        self._prev_marks: dict[str, int] = {}
        self._snap_time = 0.0
        self._reconciled = 0.0
        self._seen: dict[str, float] = {}
        self._last_heartbeat = 0.0
        self._last_journal = 0.0
        self._rounds_journals = 0  # journals_written at the end of the last round
        # The digest: the version last read (None: read it next round) and the compactor's
        # listing time it holds; what this node last wrote, when it is the compactor.
        self._digest_tag: str | None = None
        self._digest_t = 0.0
        self._digest_written = 0.0
        self._digest_live: tuple[str, ...] = ()
        #: Every node's access hints up to about this time are in the view (see _horizon).
        self._known_at = 0.0
        self._budget: float | None = None  # bytes this node may still add before its next round
        self._stop = threading.Event()
        self._pace = Pacer(config, self._stop)
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        #: What under _fleet/ did not parse (skipped until it changes; see .wire, .quarantine).
        self._quarantine = Quarantine(self.node)
        self.stats: dict[str, int] = {
            "journals_written": 0,
            "journals_read": 0,
            "digests_written": 0,
            "digests_read": 0,
            "digests_unchanged": 0,
            "snapshots_written": 0,
            "snapshots_read": 0,
            "reconciles": 0,
            "listing_rounds": 0,
            "coordination_requests": 0,
            "data_requests": 0,
            "remote_stores_seen": 0,
            "remote_deletes_seen": 0,
            "evicted_own": 0,
            "evicted_cross_node": 0,
            "refused_chunks": 0,
            "journal_gaps": 0,
            "sync_errors": 0,
        }
        self.last_error: str | None = None

    # ---- what the host tells us (cheap, any thread) -------------------------------------------
    def note_stored(self, names: Iterable[str], sizes: Iterable[int]) -> None:
        """Chunks stored (one data request each)."""
        now = time.time()
        n = 0
        with self._lock:
            for name, size in zip(names, sizes, strict=True):
                n += 1
                rec = ("s", self._view.seg(name), int(size), now)
                if self._view.apply(self.node, rec) is not None or name in self._view.entries:
                    self._buf.append(rec)
            self._served(n)

    def note_accessed(self, names: Iterable[str]) -> None:
        """Chunks found for a load (one data request each)."""
        now = time.time()
        n = 0
        with self._lock:
            for name in names:
                n += 1
                entry = self._view.entries.get(name)
                if entry is not None:
                    entry.accessed = now
                    self._accessed[name] = now
            self._served(n)

    def _served(self, n: int) -> None:
        if n:
            self.stats["data_requests"] += n
            self._pace.earn(n)

    def note_deleted(self, names: Iterable[str], *, evicted: bool = False) -> None:
        now = time.time()
        with self._lock:
            for name in names:
                entry = self._view.entries.get(name)
                if evicted and entry is not None:
                    kind = "self" if entry.writer == self.node else "other"
                    self.stats["evicted_own" if kind == "self" else "evicted_cross_node"] += 1
                    FLEET_EVICTIONS.labels(kind).inc()
                rec = ("d", self._view.seg(name), 0, now)
                self._view.apply(self.node, rec)
                self._accessed.pop(name, None)
                self._buf.append(rec)
        self._pace.hurry()

    # ---- what the host asks ----------------------------------------------------------------------
    def admit(self, sizes: list[int]) -> int:
        """How many of these chunks (in order) this node may store now: the write cap."""
        with self._lock:
            if self._budget is None:
                return len(sizes)
            n = 0
            for size in sizes:
                if size > self._budget:
                    break
                self._budget -= size
                n += 1
            self.stats["refused_chunks"] += len(sizes) - n
            return n

    def _refresh_budget(self) -> None:
        cap = self.config.write_cap
        with self._lock:
            if cap is None or self._capacity <= 0 or self._eviction.eviction_policy == "noop":
                self._budget = None
                return
            # The others' writes of the last ~LAG rounds are not in this view yet (journal, then
            # digest), so the headroom is shared as if each of them wrote its part LAG times.
            headroom = cap * self._capacity - self._view.bytes_used
            self._budget = max(0.0, headroom) / (1 + WRITE_LAG_ROUNDS * (len(self.live_nodes()) - 1))

    def _horizon(self) -> float:
        """Accesses anywhere before this are in the view: the knowledge time less one stage
        (a node in use journals its hints within a stage)."""
        return self._known_at - self.config.stage_secs

    def victims(self, busy: Container[str]) -> list[str]:
        with self._lock:
            return self._view.victims(
                capacity=self._capacity,
                eviction=self._eviction,
                now=time.time(),
                grace=self.config.grace_secs,
                max_age=self.config.max_age_secs,
                pinned=self._pinned,
                busy=busy,
                me=self.node,
                live=self.live_nodes(),
                horizon=self._horizon(),
            )

    def has_expired(self) -> bool:
        with self._lock:
            return self._view.expired(time.time(), self.config.max_age_secs, self._pinned) > 0

    def live_nodes(self) -> list[str]:
        cutoff = time.time() - self.config.node_timeout_secs
        return sorted({n for n, t in self._seen.items() if t >= cutoff} | {self.node})

    def status(self) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            return {
                "node": self.node,
                "bytes_used": self._view.bytes_used,
                "chunks": len(self._view),
                "bytes_by_cache_salt": self._view.bytes_by_salt(),
                "nodes": {n: round(now - t, 1) for n, t in sorted(self._seen.items())},
                "live_nodes": self.live_nodes(),
                "compactor": self._is_compactor(),
                "snapshot_generation": self._snap[0],
                "sync_interval_secs": self._pace.interval,
                "coordination_credit": round(self._pace.credit, 2),
                "ready": self._ready.is_set(),
                "last_error": self.last_error,
                "quarantined": self._quarantine.count,
                **self.stats,
            }

    # ---- thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvbucket-fleet-{self.node}", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and publish what is still buffered (one last journal)."""
        self._stop.set()
        self._pace.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self._flush()

    def _run(self) -> None:
        try:
            self._warm_start()
        except Exception as e:
            self._error("warm start", e)
        finally:
            self._refresh_budget()
            self._ready.set()
            self._on_ready()
        last = time.monotonic()
        while not self._pace.wait(last):
            last = time.monotonic()
            active = self._pace.begin_round()
            try:
                news = self.sync_once()
            except Exception as e:
                self._error("sync", e)
                news = True
            with self._lock:  # over the watermark: keep the pace until eviction is done
                busy = self._eviction.triggered(self._view.bytes_used, self._capacity)
            published = self.stats["journals_written"] > self._rounds_journals
            self._rounds_journals = self.stats["journals_written"]
            self._pace.end_round(active=active or published, news=news, busy=busy,
                                 compactor=self._is_compactor())

    def _error(self, what: str, e: BaseException) -> None:
        self.stats["sync_errors"] += 1
        self.last_error = f"{what}: {type(e).__name__}: {e}"
        log.warning("fleet %s failed on node %s: %s", what, self.node, self.last_error)

    def _count(self, verb: str, n: int = 1, *, prepaid: bool = False) -> None:
        """``prepaid``: the writers paid for these (journal reads; see :mod:`.pacing`)."""
        self.stats["coordination_requests"] += n
        FLEET_REQUESTS.labels(verb).inc(n)
        if not prepaid:
            self._pace.spend(n)

    # ---- one round ------------------------------------------------------------------------------------
    def _warm_start(self) -> None:
        """Digest + snapshot + one listing of ``_fleet/`` and the journals the digest does not
        hold yet (usually none: 3 requests), so lookups are right from the first one; without a
        fresh digest, the same minus the digest; a full listing only when no snapshot exists."""
        got = self._read_digest()
        changes = got[0] if got is not None else []
        listing = self._list()
        mine = [seq for seq, _ in listing.journals.get(self.node, [])]
        changes += self._fold(listing)
        with self._lock:
            self._seq = max([self._seq, self._applied.get(self.node, 0), *mine])
        if self._snap[0] < 0 and got is None:
            changes += self._reconcile()
        # No heartbeat yet: the first round writes one (or a journal), a round from now.
        self._deliver(changes)

    def sync_once(self) -> bool:
        """One round (the thread calls it when :mod:`.pacing` says; tests may call it directly).
        Returns whether anything was published or learned (else the next wait grows)."""
        flushed = self._flush()
        news = flushed
        got = None if self._is_compactor() else self._read_digest()
        if got is not None:
            changes, learned = got
            news = news or learned
            self._heartbeat()
        else:
            self.stats["listing_rounds"] += 1
            listed_at = time.time()
            listing = self._list()
            read = self.stats["journals_read"]
            changes = self._fold(listing)
            self._known_at = max(self._known_at, listed_at)
            self._heartbeat()
            news = True  # the compactor keeps the pace: the others wait for its digest
            if self._is_compactor():
                now = time.time()
                if now - self._reconciled >= self.config.reconcile_secs:
                    changes += self._reconcile()
                    self._flush()
                if self._compact_due(now):
                    self._compact(listing)
                learned = bool(changes) or self.stats["journals_read"] > read
                self._publish_digest(listed_at, flushed or learned)
        self._refresh_budget()
        self._deliver(changes)
        return news

    def _deliver(self, changes: list[Change]) -> None:
        if changes:
            self._on_changes(changes)
        self._on_tick()

    def _flush(self) -> bool:
        with self._lock:
            now = time.time()
            recs = self._buf + [("a", self._view.seg(n), 0, t) for n, t in self._accessed.items()]
            if not recs:
                return False
            self._buf, self._accessed = [], {}
        # Journals of at most JOURNAL_MAX_RECORDS (what a reader accepts, .wire), in order.
        for i in range(0, len(recs), JOURNAL_MAX_RECORDS):
            part = recs[i : i + JOURNAL_MAX_RECORDS]
            seq = self._seq + 1
            journal = Journal(self.node, seq, part, t=now, cap=self._capacity)
            # The compactor's GET (unless it is ours) and DELETE of this journal, paid by its writer.
            self._pace.spend(1 if self._is_compactor() else 2)
            try:
                self._count("put")
                self._store.put(journal_name(self._prefix, self.node, seq), journal.to_bytes())
            except Exception:
                with self._lock:  # keep them for the next round; nothing is lost
                    self._buf = [r for r in recs[i:] if r[0] != "a"] + self._buf
                raise
            with self._lock:
                self._seq = seq
                self._applied[self.node] = seq
                self._pending.setdefault(self.node, {})[seq] = part
                self._seen[self.node] = now
                self._last_journal = now
            self.stats["journals_written"] += 1
        return True

    def _read_digest(self) -> tuple[list[Change], bool] | None:
        """The compactor's digest through one conditional GET: (changes, whether they are news),
        or None when there is none or it is stale (then this round takes the listing path)."""
        started = time.time()
        self._count("get")
        name = digest_name(self._prefix)
        rev = self._store.get_if_changed(name, self._digest_tag)
        stale = started - self.config.node_timeout_secs
        if rev.tag is None:
            return None
        if rev.data is None:
            if self._digest_t < stale or self._quarantine.holds(name, rev.tag):
                return None
            self.stats["digests_unchanged"] += 1
            # Unchanged: the compactor, listing every stage, found no new journal meanwhile.
            self._known_at = max(self._known_at, self._digest_t, started - 2 * self.config.stage_secs)
            return [], False
        try:
            body = read_digest(rev.data)
        except BadObject as e:  # list this round; ask again only once it changed (no body till then)
            self._quarantine.judge(name, rev.tag, e)
            self._digest_tag = rev.tag
            return None
        t = body["t"]
        self._digest_tag, self._digest_t = rev.tag, t
        if t < stale:
            return None
        changes: list[Change] = []
        gen, snode = body["gen"], body["snode"]
        if gen >= 0 and (gen, snode) > self._snap:
            loaded = self._load_snapshot(gen, snode, snapshot_name(self._prefix, gen, snode))
            if loaded is None:
                self._digest_tag = None
                return None  # replaced since: list this round, read the next digest
            changes += loaded
        with self._lock:
            for ch in self._view.apply_delta(body):
                changes.append(ch)
                self.stats["remote_stores_seen" if ch[1] is not None else "remote_deletes_seen"] += 1
            for n, seq in body["marks"].items():
                self._applied[n] = max(self._applied.get(n, 0), seq)
            for n, seen in body["seen"].items():
                self._seen[n] = max(self._seen.get(n, 0.0), seen)
        self._known_at = max(self._known_at, t)
        self.stats["digests_read"] += 1
        return changes, bool(changes)  # a digest rewritten only to show the compactor alive is no news

    def _list(self) -> Listing:
        out = list_fleet(self._store, self._prefix)
        self._count("list", out.pages)
        with self._lock:
            for node, t in out.seen.items():
                self._seen[node] = max(self._seen.get(node, 0.0), t)
        return out

    def _fold(self, listing: Listing) -> list[Change]:
        changes: list[Change] = []
        # The newest snapshot that parses: a bad one (even at a high generation) shadows nothing.
        for gen, node, name, size in sorted(listing.snapshots, reverse=True):
            if (gen, node) <= self._snap:
                break
            if self._quarantine.holds(name, None) or self._too_big("snapshot", name, size):
                continue
            loaded = self._load_snapshot(gen, node, name)
            if loaded is not None:
                changes += loaded
                break
        todo: list[tuple[str, int, str]] = []
        with self._lock:
            for node, js in listing.journals.items():
                if node == self.node:
                    continue
                done = self._applied.get(node, 0)
                todo += [(node, seq, name) for seq, name in sorted(js) if seq > done]
        todo = [(node, seq, name) for node, seq, name in todo
                if not self._quarantine.holds(name, listing.sizes.get(name))
                and not self._too_big("journal", name, listing.sizes.get(name, 0))]
        if not todo:
            return changes
        self._count("get", len(todo), prepaid=True)
        results = self._store.get_many([name for _, _, name in todo])
        with self._lock:
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
                if seq > self._applied.get(node, 0) + 1:
                    self.stats["journal_gaps"] += 1
                self._applied[node] = max(self._applied.get(node, 0), seq)
                self._pending.setdefault(node, {})[seq] = journal.records
                for ch in self._view.apply_all(node, journal.records):
                    changes.append(ch)
                    self.stats["remote_stores_seen" if ch[1] is not None else "remote_deletes_seen"] += 1
                self.stats["journals_read"] += 1
        return changes

    def _too_big(self, kind: str, name: str, size: int | None) -> bool:
        """Too big to be a fleet object of ``kind`` by its listed size: quarantined unread."""
        if size is None or size <= MAX_STORED[kind]:
            return False
        self._quarantine.judge(name, size, f"{size} bytes, more than a fleet {kind} may hold")
        return True

    def _load_snapshot(self, gen: int, node: str, name: str) -> list[Change] | None:
        """Replace the view with a snapshot plus what is newer than it; None when it is gone or
        does not parse (then it is quarantined)."""
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
        view = FleetView.from_body(body, self._prefix, self._parse)
        marks = body["marks"]
        with self._lock:
            for n, js in self._pending.items():
                for seq in sorted(js):
                    if seq > marks.get(n, 0):
                        view.apply_all(n, js[seq])
                    else:
                        del js[seq]
            for rec in self._buf:
                view.apply(self.node, rec)
            for n, t in self._accessed.items():
                if n in view.entries:
                    view.entries[n].accessed = max(view.entries[n].accessed, t)
            # Keep the freshest access time either side knows (hints are not all journaled yet).
            for n, e in self._view.entries.items():
                mine = view.entries.get(n)
                if mine is not None and e.accessed > mine.accessed:
                    mine.accessed = e.accessed
            changes = view.diff(self._view)
            for ch in changes:  # other nodes' stores and deletes, learned through the snapshot
                self.stats["remote_stores_seen" if ch[1] is not None else "remote_deletes_seen"] += 1
            self._view = view
            for n, seq in marks.items():
                self._applied[n] = max(self._applied.get(n, 0), seq)
            self._prev_marks, self._snap_marks = self._snap_marks, marks
            self._snap = (gen, node)
            self._snap_time = body["t"]
            self._reconciled = max(self._reconciled, body["reconciled"])
        self.stats["snapshots_read"] += 1
        return changes

    def _is_compactor(self) -> bool:
        return self.live_nodes()[0] == self.node

    def _heartbeat(self, force: bool = False) -> None:
        """A journal's mtime shows liveness too: the heartbeat is written only without one."""
        now = time.time()
        if not force and now - max(self._last_heartbeat, self._last_journal) < self.config.heartbeat_secs:
            return
        body = json.dumps({"node": self.node, "t": now}).encode()
        self._count("put")
        self._store.put(heartbeat_name(self._prefix, self.node), body)
        self._last_heartbeat = now
        with self._lock:
            self._seen[self.node] = now


__all__ = ["FLEET_EVICTIONS", "Fleet"]
