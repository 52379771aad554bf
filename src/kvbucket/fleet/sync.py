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

from kvbucket.fleet.compactor import Compactor
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import Journal, Listing, heartbeat_name, journal_name, list_fleet
from kvbucket.fleet.pacing import Pacer
from kvbucket.fleet.peers import Liveness, Peers
from kvbucket.fleet.quarantine import Quarantine
from kvbucket.fleet.reader import Reader
from kvbucket.fleet.state import FleetState
from kvbucket.fleet.view import Change, FleetView
from kvbucket.fleet.wire import JOURNAL_MAX_RECORDS
from kvbucket.keys import ObjectKey
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import ObjectStore

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)

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


class Fleet:
    """See the module docstring. ``on_changes`` is called from the fleet thread. The parts:
    :class:`~.reader.Reader` (digest, snapshots, journals), :class:`~.compactor.Compactor`,
    :class:`~.peers.Liveness` and :class:`~.peers.Peers`, sharing a :class:`~.state.FleetState`."""

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
        # A Hub writer adds back what a delete removed before its re-check ran (a re-check delay
        # after the commit ends, a second later at most): twice that delay covers the put's own time.
        self._grace = max(config.grace_secs, 2 * recheck_delay(self._chunks))
        self._prefix = prefix
        self._capacity = capacity
        self._eviction = eviction or EvictionConfig(eviction_policy="noop")
        self._pinned = frozenset(config.pinned_salts)
        self._on_changes = on_changes
        self._on_tick = on_tick
        self._on_ready = on_ready
        self._state = st = FleetState(prefix, parse, FleetView(prefix, parse))
        self._lock = st.lock
        self.stats = st.stats
        self._seq = 0
        self._last_heartbeat = 0.0
        self._last_journal = 0.0
        self._rounds_journals = 0  # journals_written at the end of the last round
        # This node's clock at its last two listings, and the journals new in the last one (their
        # writers' clocks are compared with it: .peers).
        self._listed_at: float | None = None
        self._since: float | None = None
        self._fresh: set[str] = set()
        self._budget: float | None = None  # bytes this node may still add before its next round
        #: Each victim's writer, from when it was chosen until the host reports its delete: the
        #: view can lose the entry meanwhile (the compactor's reconcile lists the chunk as gone),
        #: and the eviction is still counted by whose chunk it was (note_deleted).
        self._chosen: dict[str, str] = {}
        self._stop = threading.Event()
        self._pace = Pacer(config, self._stop)
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._liveness = Liveness(self.node, config.node_timeout_secs)
        self._peers = Peers(self.node, capacity, config.node_timeout_secs,
                            f"{store.url}" + (f" (prefix {prefix})" if prefix else ""))
        #: What under _fleet/ did not parse (skipped until it changes; see .wire, .quarantine).
        self._quarantine = Quarantine(self.node)
        parts = {"liveness": self._liveness, "peers": self._peers, "quarantine": self._quarantine,
                 "count": self._count}
        self._reader = Reader(self.node, store, config, st, **parts)
        self._compactor = Compactor(self.node, store, self._chunks, config, st, flush=self._flush, **parts)
        self.last_error: str | None = None

    # ---- what the host tells us (cheap, any thread) -------------------------------------------
    def note_stored(self, names: Iterable[str], sizes: Iterable[int]) -> None:
        """Chunks stored (one data request each)."""
        now = time.time()
        n = 0
        with self._lock:
            for name, size in zip(names, sizes, strict=True):
                n += 1
                rec = ("s", self._state.view.seg(name), int(size), now)
                if self._state.view.apply(self.node, rec) is not None or name in self._state.view.entries:
                    self._state.buf.append(rec)
            self._served(n)

    def note_accessed(self, names: Iterable[str]) -> None:
        """Chunks found for a load (one data request each)."""
        now = time.time()
        n = 0
        with self._lock:
            for name in names:
                n += 1
                entry = self._state.view.entries.get(name)
                if entry is not None:
                    entry.accessed = now
                    self._state.accessed[name] = now
            self._served(n)

    def _served(self, n: int) -> None:
        if n:
            self.stats["data_requests"] += n
            self._pace.earn(n)

    def note_deleted(self, names: Iterable[str], *, evicted: bool = False) -> None:
        now = time.time()
        with self._lock:
            for name in names:
                entry = self._state.view.entries.get(name)
                writer = self._chosen.pop(name, None) or (entry.writer if entry is not None else None)
                if evicted and writer is not None:
                    kind = "self" if writer == self.node else "other"
                    self.stats["evicted_own" if kind == "self" else "evicted_cross_node"] += 1
                    FLEET_EVICTIONS.labels(kind).inc()
                rec = ("d", self._state.view.seg(name), 0, now)
                self._state.view.apply(self.node, rec)
                self._state.accessed.pop(name, None)
                self._state.buf.append(rec)
        self._pace.hurry()

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """The size the view holds for each of ``names`` it knows."""
        with self._lock:
            entries = self._state.view.entries
            return {n: e.size for n in names if (e := entries.get(n)) is not None}

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
            headroom = cap * self._capacity - self._state.view.bytes_used
            self._budget = max(0.0, headroom) / (1 + WRITE_LAG_ROUNDS * (len(self.live_nodes()) - 1))

    def _horizon(self) -> float:
        """Accesses anywhere before this are in the view: the knowledge time less one stage
        (a node in use journals its hints within a stage)."""
        return self._state.known_at - self.config.stage_secs

    def victims(self, busy: Container[str]) -> list[str]:
        with self._lock:
            chosen = self._state.view.victims(
                capacity=self._capacity,
                eviction=self._eviction,
                now=time.time(),
                grace=self._grace,
                max_age=self.config.max_age_secs,
                pinned=self._pinned,
                busy=busy,
                me=self.node,
                live=self.live_nodes(),
                horizon=self._horizon(),
            )
            entries = self._state.view.entries
            # Victims still being deleted are busy; any other name left here was not deleted.
            self._chosen = {n: w for n, w in self._chosen.items() if n in busy}
            self._chosen.update((n, entries[n].writer) for n in chosen)
            return chosen

    def has_expired(self) -> bool:
        with self._lock:
            return self._state.view.expired(time.time(), self.config.max_age_secs, self._pinned) > 0

    def live_nodes(self) -> list[str]:
        """This node and every node seen making progress within ``node_timeout_secs`` (on this
        node's own clock: :class:`~.peers.Liveness`)."""
        return self._liveness.live()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "node": self.node,
                "bytes_used": self._state.view.bytes_used,
                "chunks": len(self._state.view),
                "bytes_by_cache_salt": self._state.view.bytes_by_salt(),
                "nodes": {n: round(a, 1) for n, a in sorted(self._liveness.ages().items())},
                "live_nodes": self.live_nodes(),
                "compactor": self._is_compactor(),
                "snapshot_generation": self._state.snap[0],
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
                busy = self._eviction.triggered(self._state.view.bytes_used, self._capacity)
            published = self.stats["journals_written"] > self._rounds_journals
            self._rounds_journals = self.stats["journals_written"]
            self._pace.end_round(active=active or published, news=news, busy=busy,
                                 compactor=self._is_compactor())

    def _error(self, what: str, e: BaseException) -> None:
        self.stats["sync_errors"] += 1
        self.last_error = f"{what}: {type(e).__name__}: {e}"
        # A failure that persists (a dead endpoint, a revoked token) fails every round the same way:
        # one line, then a count (per kind of failure; the message may vary in its details).
        _repeated.warning("fleet %s failed on node %s: %s", what, self.node, self.last_error,
                          same=f"fleet {what} failed on node {self.node}: {type(e).__name__}")

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
        got = self._reader.read_digest()
        changes = got[0] if got is not None else []
        listing = self._list()
        mine = [seq for seq, _ in listing.journals.get(self.node, [])]
        changes += self._fold(listing)
        with self._lock:
            self._seq = max([self._seq, self._state.applied.get(self.node, 0), *mine])
        if self._state.snap[0] < 0 and got is None:
            changes += self._compactor.reconcile()
        # No heartbeat yet: the first round writes one (or a journal), a round from now.
        self._deliver(changes)

    def sync_once(self) -> bool:
        """One round (the thread calls it when :mod:`.pacing` says; tests may call it directly).
        Returns whether anything was published or learned (else the next wait grows)."""
        flushed = self._flush()
        news = flushed
        got = None if self._is_compactor() else self._reader.read_digest()
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
            self._state.known_at = max(self._state.known_at, listed_at)
            self._heartbeat()
            news = True  # the compactor keeps the pace: the others wait for its digest
            if self._is_compactor():
                now = time.time()
                if now - self._state.reconciled >= self.config.reconcile_secs:
                    changes += self._compactor.reconcile()
                    self._flush()
                if self._compactor.compact_due(now):
                    self._compactor.compact(listing)
                learned = bool(changes) or self.stats["journals_read"] > read
                if self._compactor.publish_digest(listed_at, flushed or learned):
                    self._reader.tag = None  # ours: read it in full if this node is a reader again
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
            st = self._state
            recs = st.buf + [("a", st.view.seg(n), 0, t) for n, t in st.accessed.items()]
            if not recs:
                return False
            self._state.buf, self._state.accessed = [], {}
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
                    self._state.buf = [r for r in recs[i:] if r[0] != "a"] + self._state.buf
                raise
            with self._lock:
                self._seq = seq
                self._state.applied[self.node] = seq
                self._state.pending.setdefault(self.node, {})[seq] = part
                self._last_journal = now
            self.stats["journals_written"] += 1
        return True

    def read_only(self) -> bool:
        """Read the fleet's picture without writing anything (``kvbucket du``): the digest, else
        one listing and what it names. False when no fleet ever wrote here."""
        if self._reader.read_digest(once=True) is not None:
            return True
        listing = self._list(reference=time.time())
        if not listing.snapshots and not listing.journals:
            return False
        self._fold(listing)
        return True

    def _list(self, reference: float | None = None) -> Listing:
        """List ``_fleet/`` (one page while it holds < 1000 objects) and note who progressed
        (``reference``: see :meth:`.peers.Liveness.observe_listing`)."""
        out = list_fleet(self._store, self._prefix)
        self._count("list", out.pages)
        self._fresh = self._liveness.observe_listing(out, reference)
        self._since, self._listed_at = self._listed_at, out.at
        return out

    def _fold(self, listing: Listing) -> list[Change]:
        return self._reader.fold(listing, self._fresh, self._since)

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



def recheck_delay(store: ObjectStore) -> float:
    """``recheck_delay_secs`` of the Hub store under ``store``'s wrappers (0 for other stores).

    A Hub writer adds back, that long after its commit, a version a delete removed meanwhile
    (stores/hub/rechecks.py): an eviction of a chunk younger than that would be undone, and the
    chunk left stored but counted as deleted by the fleet. The fleet's grace is at least twice it.
    """
    seen: set[int] = set()
    node: Any = store
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        rechecks = node.__dict__.get("rechecks") if hasattr(node, "__dict__") else None
        if rechecks is not None:
            return float(getattr(rechecks, "delay", 0.0))
        node = getattr(node, "inner", None) or getattr(node, "raw", None) or getattr(node, "sealed", None)
    return 0.0

__all__ = ["FLEET_EVICTIONS", "Fleet"]
