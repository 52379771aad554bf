"""A bounded log of the requests the emulator served, to count a client's sequential round trips.

Why server-side: a client's own view (or a wall-clock estimate) hides how many of its requests
waited for one another. Each entry has the route, its start and end in the server's monotonic
clock, and its causal marks: the connection it came on, its place in the server's order of
events (``seq``: arrival, answer), and digests of the credentials it used (``uses``: a Xet token,
a fetch URL's signature) and of those its answer handed out (``hands``).

Round trips are counted from causal order, not from time gaps: request B follows answer A when
B was provably sent after A was received: B came on A's connection after A was answered (HTTP/1.1
sends nothing on a connection before its answer is read), or B used a credential that only A's
answer (or an earlier one) handed out. Why not time gaps: the server notices a request when its
event loop reads it, and an emulator sharing a busy process (the test's own load threads, on two
loaded cores) read some of 64 requests sent together after others were answered, counting two
chains where the client made one (CI flakes of test_hfbucket_round_trips). A causal edge
implies a time gap, so the causal count never exceeds the time-gap count.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

#: Entries kept; older ones are dropped (a benchmark clears the log before what it measures).
MAX_ENTRIES = 100_000


class RequestLog:
    """What ``GET /_emulator/requests`` returns (and ``DELETE`` clears); thread-safe."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=max_entries)
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def arrived(self) -> int:
        """The next place in the server's order of events: call when a request is read."""
        return next(self._seq)

    def record(self, route: str, start: float, end: float | None = None, *, conn: str | None = None,
               seq_in: int | None = None, uses: tuple[str, ...] = (), hands: tuple[str, ...] = ()) -> None:
        """One request served (call before its answer leaves: the answer's place is taken here)."""
        finished = time.monotonic() if end is None else end
        entry: dict[str, Any] = {"route": route, "start": start, "end": finished}
        if conn is not None and seq_in is not None:
            entry.update(conn=conn, seq=[seq_in, next(self._seq)], uses=list(uses), hands=list(hands))
        with self._lock:
            self._entries.append(entry)

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._entries]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def digest(secret: str) -> str:
    """What the log keeps of a credential: enough to match a use to its issue, not the value."""
    return hashlib.blake2b(secret.encode(), digest_size=8).hexdigest()


def sequential_round_trips(
    entries: Iterable[dict[str, Any]], *, exclude: Sequence[str] = ("control", "telemetry")
) -> int:
    """The longest chain of requests in ``entries``, each sent after the previous one's answer
    was received: from causal order when the entries carry it (see the module docstring), else
    (entries made by hand) each starting after the previous ended.

    ``exclude`` drops routes no client waits on (the control routes, fire-and-forget telemetry).
    """
    kept = [e for e in entries if e["route"] not in exclude]
    if kept and all("seq" in e for e in kept):
        return causal_round_trips(kept)
    spans = sorted((float(e["start"]), float(e["end"])) for e in kept)
    ends: list[float] = []  # sorted ends of the spans seen so far
    best: list[int] = []  # best[k]: the longest chain ending at or before ends[k] (running max)
    longest = 0
    for start, end in spans:
        k = bisect_right(ends, start)  # spans that ended before this one started
        chain = (best[k - 1] if k else 0) + 1
        pos = bisect_right(ends, end)
        ends.insert(pos, end)
        best.insert(pos, max(chain, best[pos - 1] if pos else 0))
        for j in range(pos + 1, len(best)):  # keep the running maximum
            if best[j] >= best[pos]:
                break
            best[j] = best[pos]
        longest = max(longest, chain)
    return longest


def causal_round_trips(entries: Sequence[dict[str, Any]]) -> int:
    """The longest chain of causal edges: B after A on A's connection, or B using a credential
    first handed out by A (the earliest answer that handed it out, answered before B came)."""
    order = sorted(entries, key=lambda e: e["seq"][0])
    on_conn: dict[str, list[tuple[int, int]]] = {}  # conn -> (answer seq, chain) in arrival order
    handed: dict[str, list[tuple[int, int]]] = {}  # credential -> (answer seq, chain) of its issuers
    longest = 0
    for e in order:
        seq_in, seq_out = e["seq"]
        before = 0
        for out, chain in reversed(on_conn.get(e["conn"], [])):
            if out < seq_in:  # the previous request on this connection, answered before this came
                before = max(before, chain)
                break
        for used in e.get("uses", ()):
            issued = [(out, chain) for out, chain in handed.get(used, []) if out < seq_in]
            if issued:
                before = max(before, min(issued)[1])  # the earliest answer that handed it out
        chain = before + 1
        on_conn.setdefault(e["conn"], []).append((seq_out, chain))
        for h in e.get("hands", ()):
            handed.setdefault(h, []).append((seq_out, chain))
        longest = max(longest, chain)
    return longest


def count_routes(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Requests per route."""
    out: dict[str, int] = {}
    for e in entries:
        out[e["route"]] = out.get(e["route"], 0) + 1
    return out


__all__ = ["RequestLog", "causal_round_trips", "count_routes", "digest", "sequential_round_trips"]
