"""What a node learns of the others: who is alive, judged on its own clock, and where their
clocks or capacities disagree with its own (warned once).

**Liveness without trusting clocks.** A node is alive while it makes *progress*: a journal with a
sequence number not listed before, or a rewritten heartbeat (its listed mtime and size, used only
as a version). :class:`Liveness` notes the time of each progress on this node's own monotonic
clock, and a node is live while that is within ``node_timeout_secs``. No other node's timestamp is
compared with this node's clock, so a node whose clock is an hour ahead (or behind) neither
declares the others dead nor becomes a second compactor. The compactor's digest carries *ages*
(seconds since it saw each node progress, on its own clock), which readers add to the time they
read it; a digest that changed is progress of its writer. The first listing has no history: a
node is then as old as its newest object is older than the other nodes' newest object (both on
the store's or the writers' clocks, never this node's; one far ahead of the rest is left out);
the next progress corrects a wrong guess.

**Disagreements** (:class:`Peers`): a journal and the digest carry their writer's clock at write
time and its capacity. A clock more than ``node_timeout_secs`` away from this node's, over the
interval in which the object must have been written, or a different ``max_capacity_gb``, is
logged once per node: records merge by wall-clock time, and the prefix settles between two
capacities, so both need the operator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvbucket.fleet.layout import Listing

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, me: str, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.me = me
        self.timeout = timeout
        self._clock = clock
        self._at: dict[str, float] = {}  # node -> this node's clock at its last progress seen
        self._seqs: dict[str, frozenset[int]] = {}  # journal seqs in the last listing, per node
        self._beats: dict[str, tuple[float | None, int] | None] = {}
        self._lock = threading.Lock()

    def _bump(self, node: str, at: float) -> None:
        if node != self.me:
            self._at[node] = max(self._at.get(node, at), at)

    def saw(self, node: str) -> None:
        """``node`` made progress just now (e.g. the digest it writes changed)."""
        with self._lock:
            self._bump(node, self._clock())

    def observe_listing(self, listing: Listing, reference: float | None = None) -> set[str]:
        """Note every node's progress in this listing of ``_fleet/``; returns the journals not
        listed the previous time (empty on the first listing: their age is unknown).
        ``reference``: what a node first seen is as old as it is older than (default: the newest
        object listed; ``kvbucket du``, looking once, gives its wall clock)."""
        now = self._clock()
        newest = self._reference(listing) if reference is None else reference
        fresh: set[str] = set()
        with self._lock:
            first = not self._seqs and not self._beats
            for node in set(listing.journals) | set(listing.beats):
                js = listing.journals.get(node, [])
                seqs = frozenset(seq for seq, _ in js)
                beat = listing.beats.get(node)
                if node not in self._seqs:
                    # No history: as old as its newest object is older than the newest listed.
                    self._bump(node, now - max(0.0, newest - listing.seen.get(node, newest)))
                else:
                    new = seqs - self._seqs[node]
                    # A store without mtimes gives no heartbeat version: every listing counts.
                    if new or beat != self._beats.get(node) or (beat is not None and beat[0] is None):
                        self._bump(node, now)
                    if not first:
                        fresh |= {name for seq, name in js if seq in new}
                self._seqs[node], self._beats[node] = seqs, beat
        return fresh

    def _reference(self, listing: Listing) -> float:
        """The newest object of the other nodes, leaving out any that is more than
        ``node_timeout_secs`` ahead of the next newest (a clock far ahead would make every other
        node look old; dead nodes' old heartbeats, which lie behind, are what it must not hide)."""
        times = sorted((t for n, t in listing.seen.items() if n != self.me), reverse=True)
        while len(times) > 1 and times[0] - times[1] > self.timeout:
            times.pop(0)
        return times[0] if times else 0.0

    def observe_ages(self, ages: dict[str, float]) -> None:
        """A digest read just now: each node progressed ``age`` seconds ago (its writer's clock)."""
        now = self._clock()
        with self._lock:
            for node, age in ages.items():
                self._bump(node, now - max(0.0, age))

    def age(self, node: str) -> float | None:
        """Seconds since ``node`` was seen making progress (None: never)."""
        if node == self.me:
            return 0.0
        with self._lock:
            t = self._at.get(node)
            return None if t is None else self._clock() - t

    def ages(self) -> dict[str, float]:
        """Every node seen, this one included (0), with the seconds since its last progress."""
        now = self._clock()
        with self._lock:
            return {**{n: now - t for n, t in self._at.items()}, self.me: 0.0}

    def live(self) -> list[str]:
        now = self._clock()
        with self._lock:
            return sorted({n for n, t in self._at.items() if now - t <= self.timeout} | {self.me})


class Peers:
    """Capacity and clock disagreements with the other nodes, each warned once per node."""

    def __init__(self, me: str, capacity: int, timeout: float, where: str) -> None:
        self.me, self.capacity, self.timeout, self.where = me, capacity, timeout, where
        self.caps: dict[str, int] = {me: capacity} if capacity > 0 else {}
        self.skews: dict[str, float] = {}  # node -> seconds its clock is ahead (< 0: behind)
        self._behind: dict[str, int] = {}  # node -> objects in a row whose stamp read behind
        self._warned_caps: set[tuple[str, int]] = set()

    def capacity_of(self, node: str, cap: int) -> None:
        """``node`` shares this prefix with ``cap`` bytes of capacity (0: none, not compared)."""
        if cap <= 0 or node == self.me:
            return
        self.caps[node] = cap
        if self.capacity > 0 and cap != self.capacity and (node, cap) not in self._warned_caps:
            self._warned_caps.add((node, cap))
            log.warning("fleet on %s: node %s has max_capacity_gb %s, this node (%s) %s; the prefix "
                        "settles somewhere between the two and the write cap differs by node. Give "
                        "every node of a prefix the same max_capacity_gb", self.where, node,
                        _gb(cap), self.me, _gb(self.capacity))

    def clock_of(self, node: str, theirs: float, lo: float | None, hi: float) -> None:
        """``node``'s clock read ``theirs`` at a moment this node's clock placed in ``[lo, hi]``
        (``lo`` None: unknown, only "ahead" can be told).

        A stamp ahead is a clock ahead: nothing makes an object land before it was written. A
        stamp behind may be a write that landed late (a journal whose put retried through an
        outage reads 95 s behind on one machine), so "behind" is told only when two objects in a
        row read so; the node that is really behind also sees this one ahead, and says so."""
        if node == self.me:
            return
        if theirs > hi + self.timeout:
            skew = theirs - hi
            self._behind.pop(node, None)
        elif lo is not None and theirs < lo - self.timeout:
            skew = theirs - lo
            self._behind[node] = self._behind.get(node, 0) + 1
            if self._behind[node] < 2:
                return
        else:
            self._behind.pop(node, None)
            return
        if node in self.skews:
            self.skews[node] = skew
            return
        self.skews[node] = skew
        log.warning("fleet on %s: node %s's clock is about %.0f s %s this node's (%s), more than "
                    "node_timeout_secs (%g). Liveness does not depend on it, but records merge by "
                    "wall-clock time: the chunks of the node that is ahead look newer than they are "
                    "and are evicted last. Synchronise the clocks (NTP)", self.where, node, abs(skew),
                    "ahead of" if skew > 0 else "behind", self.me, self.timeout)


def _gb(n: int) -> str:
    return f"{n / 1024**3:g}"


__all__ = ["Liveness", "Peers"]
