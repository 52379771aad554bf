"""Per-route fault injection, so clients' retry and partial-failure paths are tested for real.

A rule matches a route name (see ``ROUTES``) and, when it fires, adds latency, answers with an
error status, drops the connection part-way through the response body, trickles the body (one
byte every ``trickle_s``: a slow answer that per-read timeouts never catch), fails one line
of a batch request, or sets fields of a JSON answer (``json_set``: a malformed answer, such as
a reconstruction with a negative length). Rules are plain data (JSON over
``/_emulator/faults``), so a server running in a subprocess is driven the same way as one in a
thread.
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

ROUTES = (
    "create_bucket", "bucket_info", "list_buckets", "delete_bucket", "move_bucket", "bucket_settings", "tree",
    "paths_info", "batch", "xet_token", "resolve", "whoami", "xorb_upload", "xorb_grant",
    "shard_upload", "reconstruction", "fetch", "dedup", "telemetry", "file_chunk_hashes",
)  # fmt: skip


@dataclass
class FaultRule:
    """One fault. ``route`` is a name from ``ROUTES`` or ``"*"``.

    Firing: every matching request with probability ``probability`` (seeded, reproducible),
    or only the ``nth`` matching request (1-based) when given; at most ``times`` firings.
    Effects (any combination): ``latency_s`` delay, ``status`` error reply, ``drop`` the
    connection mid-body, ``trickle_s`` sends the body one byte every that many seconds (headers
    at once), ``fail_batch_line`` (1-based) fails that line of a batch, ``flip`` flips one bit in
    the middle of a ``fetch`` body (damage on the wire; the stored bytes stay intact),
    ``json_set`` sets values in a JSON answer (keys are ``/``-separated paths, list indexes as
    numbers: ``{"terms/0/unpacked_length": -1}``).
    """

    route: str
    status: int | None = None
    probability: float = 1.0
    nth: int | None = None
    times: int | None = None
    latency_s: float = 0.0
    drop: bool = False
    trickle_s: float = 0.0
    fail_batch_line: int | None = None
    flip: bool = False
    json_set: dict[str, Any] | None = None
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.route != "*" and self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}; known routes: {', '.join(ROUTES)}")
        if self.status is not None and not 400 <= self.status <= 599:
            raise ValueError(f"fault status must be a 4xx or 5xx code, not {self.status}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("fault probability must be between 0 and 1")
        if not 0.0 <= self.trickle_s <= 60.0:
            raise ValueError("fault trickle_s must be between 0 and 60 seconds per byte")


@dataclass
class Fault:
    """What to do to one request (the union of the rules that fired)."""

    status: int | None = None
    latency_s: float = 0.0
    drop: bool = False
    trickle_s: float = 0.0
    flip: bool = False
    fail_batch_lines: set[int] = field(default_factory=set)
    json_set: dict[str, Any] = field(default_factory=dict)


class FaultPlan:
    def __init__(self, seed: int = 0) -> None:
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def add(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append(rule)

    def reset(self) -> None:
        with self._lock:
            self._rules.clear()

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(r) for r in self._rules]

    def check(self, route: str) -> Fault | None:
        with self._lock:
            if not self._rules:
                return None
            out: Fault | None = None
            for r in self._rules:
                if r.route not in ("*", route):
                    continue
                r.seen += 1
                if r.times is not None and r.fired >= r.times:
                    continue
                hit = r.seen == r.nth if r.nth is not None else self._rng.random() < r.probability
                if not hit:
                    continue
                r.fired += 1
                out = out or Fault()
                out.latency_s += r.latency_s
                out.status = r.status if r.status is not None else out.status
                out.drop = out.drop or r.drop
                out.flip = out.flip or r.flip
                out.trickle_s = max(out.trickle_s, r.trickle_s)
                if r.fail_batch_line is not None:
                    out.fail_batch_lines.add(r.fail_batch_line)
                if r.json_set:
                    out.json_set.update(r.json_set)
            return out


def set_json(doc: Any, changes: dict[str, Any]) -> Any:
    """``doc`` with each ``path -> value`` of ``changes`` set (paths that lead nowhere are skipped)."""
    for path, value in changes.items():
        *parents, last = path.split("/")
        node = doc
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value
        except (KeyError, IndexError, ValueError, TypeError):
            continue
    return doc
