"""A bounded log of the requests the emulator served, to count a client's sequential round trips.

Why server-side: a client's own view (or a wall-clock estimate) hides how many of its requests
waited for one another. Each entry is (route, start, end) in the server's monotonic clock; the
longest chain of requests each starting after the previous one ended is the number of round
trips the client's work needed, whatever latency the fault rules add.
"""

from __future__ import annotations

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
        self._entries: deque[tuple[str, float, float]] = deque(maxlen=max_entries)
        self._lock = threading.Lock()

    def record(self, route: str, start: float, end: float | None = None) -> None:
        with self._lock:
            self._entries.append((route, start, time.monotonic() if end is None else end))

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"route": r, "start": s, "end": e} for r, s, e in self._entries]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def sequential_round_trips(
    entries: Iterable[dict[str, Any]], *, exclude: Sequence[str] = ("control", "telemetry")
) -> int:
    """The longest chain of requests in ``entries`` where each starts after the previous ended.

    ``exclude`` drops routes no client waits on (the control routes, fire-and-forget telemetry).
    """
    spans = sorted((float(e["start"]), float(e["end"])) for e in entries if e["route"] not in exclude)
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


def count_routes(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Requests per route."""
    out: dict[str, int] = {}
    for e in entries:
        out[e["route"]] = out.get(e["route"], 0) + 1
    return out


__all__ = ["RequestLog", "count_routes", "sequential_round_trips"]
