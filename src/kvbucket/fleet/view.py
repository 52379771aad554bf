"""The fleet's shared picture of a prefix: every chunk with its size, salt, times and writer.

A :class:`FleetView` is folded from a snapshot plus journal records (see
:mod:`kvbucket.fleet.layout`). Records from different nodes arrive late and out of order, so
each name keeps the newest fact by wall-clock time (last writer wins, like the store itself):
a delete older than the store it meets is ignored, and a recent delete leaves a tombstone so
an older store arriving after it is ignored too. Applying a record twice changes nothing,
which is what lets a snapshot and the journals it folded overlap safely.

:meth:`FleetView.victims` is the fleet-wide eviction choice every node computes alike from
its view; each node deletes only the victims it owns (``crc32(name) mod live nodes``), so
no two nodes with the same view delete the same chunks.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote

from kvbucket.errors import InvalidKeyError
from kvbucket.fleet.layout import Record
from kvbucket.keys import ObjectKey

TOMBSTONE_SECS = 900.0


class Eviction(Protocol):
    """What the eviction choice asks of :class:`kvbucket.l2.eviction.EvictionConfig` (this module
    imports nothing of :mod:`kvbucket.l2`, whose adapter imports it)."""

    def triggered(self, used: int, capacity: int) -> bool: ...

    def target_bytes(self, capacity: int) -> int: ...
_FOREIGN_RE = re.compile(r"[^A-Za-z0-9_@~%-]")  # a character the key encoding never writes
_HEX_RE = re.compile(r"^[0-9a-f]+$")


@dataclass(slots=True)
class FleetEntry:
    size: int
    salt: str
    stored: float
    accessed: float
    writer: str

    @property
    def last_used(self) -> float:
        return max(self.stored, self.accessed)


#: A change the adapter mirrors into its index: (name, size) when present, (name, None) when gone.
Change = tuple[str, int | None]


def _segment(name: str, prefix: str) -> str | None:
    if prefix:
        if not name.startswith(prefix + "/"):
            return None
        name = name[len(prefix) + 1 :]
    return None if not name or _FOREIGN_RE.search(name) else name


def salt_of(name: str, prefix: str) -> str | None:
    """The ``cache_salt`` of a chunk's object name, or None when the name is not an ObjectKey's.

    Fast (no full decode): ``@`` is never escaped by the encoding and a model name or salt
    never holds one, so the encoded name splits into the key's fields as it is.
    """
    seg = _segment(name, prefix)
    if seg is None:
        return None
    parts = seg.split("@")
    if len(parts) not in (3, 4) or not _HEX_RE.match(parts[1]) or not _HEX_RE.match(parts[2]):
        return None
    try:
        return unquote(parts[3], errors="strict") if len(parts) == 4 else ""
    except UnicodeDecodeError:  # not an encoded salt: not a chunk (names come from the bucket)
        return None


def key_of(name: str, prefix: str) -> ObjectKey | None:
    """The key an object name holds, or None for anything that is not a chunk of this prefix
    (a C-speed unquote: the index of 100,000 chunks is decoded at every warm start)."""
    seg = _segment(name, prefix)
    if seg is None:
        return None
    try:
        return ObjectKey.from_string(unquote(seg, errors="strict"))
    except (InvalidKeyError, UnicodeDecodeError):
        return None


def owner(name: str, live: list[str]) -> str:
    """Which of the (sorted) live nodes deletes ``name`` when it is a victim."""
    return live[zlib.crc32(name.encode()) % len(live)]


class FleetView:
    """Not thread-safe: :class:`kvbucket.fleet.sync.Fleet` guards it with its lock."""

    def __init__(self, prefix: str = "", parse: Callable[[str], ObjectKey | None] | None = None) -> None:
        self.prefix = prefix
        #: Parses object names of other formats (LMCache's, see kvbucket.l2.naming) as a fallback.
        self.parse = parse
        self.entries: dict[str, FleetEntry] = {}
        self.tombs: dict[str, float] = {}
        self.bytes_used = 0
        self._by_salt: dict[str, int] = {}
        #: Names any record touched since this view was made (the compactor's digest rows).
        self.touched: set[str] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def salt(self, name: str) -> str | None:
        """The salt of a chunk's name (kvbucket's or, through ``parse``, LMCache's), or None."""
        salt = salt_of(name, self.prefix)
        if salt is None and self.parse is not None:
            try:
                key = self.parse(name)
            except ValueError:  # a name from the bucket that no parser expected: not a chunk
                return None
            return None if key is None else key.cache_salt
        return salt

    def _name(self, seg: str) -> str:
        return f"{self.prefix}/{seg}" if self.prefix else seg

    def seg(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _count(self, salt: str, delta: int) -> None:
        self.bytes_used += delta
        left = self._by_salt.get(salt, 0) + delta
        if left > 0:
            self._by_salt[salt] = left
        else:
            self._by_salt.pop(salt, None)

    def bytes_by_salt(self) -> dict[str, int]:
        return dict(self._by_salt)

    # ---- folding records ---------------------------------------------------------------
    def apply(self, node: str, rec: Record) -> Change | None:
        """Fold one record (from ``node``); returns the change in presence or size, if any."""
        op, seg, size, t = rec
        name = self._name(seg)
        entry = self.entries.get(name)
        self.touched.add(name)
        if op == "a":
            if entry is not None and t > entry.accessed:
                entry.accessed = t
            return None
        if op == "s":
            if size <= 0 or self.tombs.get(name, float("-inf")) > t:
                return None
            if entry is None:
                salt = self.salt(name)
                if salt is None:
                    return None
                self.entries[name] = FleetEntry(size, salt, t, t, node)
                self.tombs.pop(name, None)
                self._count(salt, size)
                return (name, size)
            if t < entry.stored:
                return None
            old = entry.size
            entry.size, entry.stored, entry.writer = size, t, node
            entry.accessed = max(entry.accessed, t)
            if old != size:
                self._count(entry.salt, size - old)
                return (name, size)
            return None
        if op == "d":
            if entry is not None and entry.stored > t:
                return None
            self.tombs[name] = max(self.tombs.get(name, t), t)
            if entry is None:
                return None
            del self.entries[name]
            self._count(entry.salt, -entry.size)
            return (name, None)
        return None

    def apply_all(self, node: str, records: Iterable[Record]) -> list[Change]:
        out = []
        for rec in records:
            ch = self.apply(node, rec)
            if ch is not None:
                out.append(ch)
        return out

    def prune_tombs(self, now: float, keep_secs: float = TOMBSTONE_SECS) -> None:
        cutoff = now - keep_secs
        self.tombs = {n: t for n, t in self.tombs.items() if t >= cutoff}

    def diff(self, old: FleetView) -> list[Change]:
        """What changed from ``old`` to this view (presence and size)."""
        out: list[Change] = [(n, None) for n in old.entries if n not in self.entries]
        for n, e in self.entries.items():
            o = old.entries.get(n)
            if o is None or o.size != e.size:
                out.append((n, e.size))
        return out

    # ---- snapshots -----------------------------------------------------------------------
    def to_body(self) -> dict[str, object]:
        return {
            "e": [[self.seg(n), e.size, e.stored, e.accessed, e.writer] for n, e in self.entries.items()],
            "tomb": [[self.seg(n), t] for n, t in self.tombs.items()],
        }

    @classmethod
    def from_body(
        cls, body: dict[str, object], prefix: str, parse: Callable[[str], ObjectKey | None] | None = None
    ) -> FleetView:
        view = cls(prefix, parse)
        for seg, size, stored, accessed, writer in body.get("e", []):  # type: ignore[union-attr]
            name = view._name(str(seg))
            salt = view.salt(name)
            if salt is None or int(size) <= 0:
                continue
            view.entries[name] = FleetEntry(int(size), salt, float(stored), float(accessed), str(writer))
            view._count(salt, int(size))
        for seg, t in body.get("tomb", []):  # type: ignore[union-attr]
            view.tombs[view._name(str(seg))] = float(t)
        return view

    # ---- digests: what changed since the snapshot, as rows ------------------------------------
    def delta_body(self) -> dict[str, object]:
        """Every touched chunk as it is now: an entry row, or a tombstone row when deleted."""
        e, tomb = [], []
        for n in self.touched:
            entry = self.entries.get(n)
            if entry is not None:
                e.append([self.seg(n), entry.size, entry.stored, entry.accessed, entry.writer])
            elif n in self.tombs:
                tomb.append([self.seg(n), self.tombs[n]])
        return {"e": e, "tomb": tomb}

    def apply_delta(self, body: dict[str, object]) -> list[Change]:
        """Fold a digest's rows (idempotent, last writer wins like journal records)."""
        out: list[Change] = []
        for seg, t in body.get("tomb", []):  # type: ignore[union-attr]
            ch = self.apply("", ("d", str(seg), 0, float(t)))
            if ch is not None:
                out.append(ch)
        for seg, size, stored, accessed, writer in body.get("e", []):  # type: ignore[union-attr]
            ch = self.apply(str(writer), ("s", str(seg), int(size), float(stored)))
            self.apply(str(writer), ("a", str(seg), 0, float(accessed)))
            if ch is not None:
                out.append(ch)
        return out

    # ---- eviction --------------------------------------------------------------------------
    def expired(self, now: float, max_age: float | None, pinned: Container[str]) -> int:
        if max_age is None:
            return 0
        cutoff = now - max_age
        return sum(1 for e in self.entries.values() if e.stored < cutoff and e.salt not in pinned)

    def victims(
        self,
        *,
        capacity: int,
        eviction: Eviction,
        now: float,
        grace: float,
        max_age: float | None,
        pinned: Container[str],
        busy: Container[str],
        me: str,
        live: list[str],
        horizon: float | None = None,
    ) -> list[str]:
        """This node's share of the fleet-wide victims: expired chunks, then least recently
        used ones (by fleet access hints) from the salt furthest above its fair share, until
        fleet usage reaches the eviction target. A salt at or under its share loses nothing
        while another salt is over its share. Pinned salts, busy names (locked or being
        deleted here) and chunks used within ``grace`` seconds are never chosen.

        ``horizon``: the time up to which this view surely holds every node's access hints;
        "used within grace" counts back from it, not from ``now``, so a chunk another node is
        reading stays protected however late its hints arrive."""
        live = sorted(set(live) | {me})
        recent = min(now, horizon if horizon is not None else now) - grace
        cutoff = now - max_age if max_age is not None else float("-inf")
        chosen: list[str] = []
        usage = self.bytes_by_salt()
        used = self.bytes_used
        queues: dict[str, list[tuple[float, str]]] = {}
        for name, e in self.entries.items():
            if e.salt in pinned or name in busy or e.last_used > recent:
                continue
            if e.stored < cutoff:
                chosen.append(name)
                usage[e.salt] -= e.size
                used -= e.size
            else:
                queues.setdefault(e.salt, []).append((e.last_used, name))
        if eviction.triggered(used, capacity):
            target = eviction.target_bytes(capacity)
            share = target / max(1, len(usage))
            for q in queues.values():
                q.sort(reverse=True)  # pop() takes the least recently used
            while used > target:
                # Only salts above their share give chunks while any salt is above its share,
                # even when that salt's excess is still in its grace period (then wait for it).
                over = [s for s, b in usage.items() if b > share]
                candidates = [s for s in (over or queues) if queues.get(s)]
                if not candidates:
                    break
                salt = max(candidates, key=lambda s: usage.get(s, 0) - share)
                _, name = queues[salt].pop()
                size = self.entries[name].size
                chosen.append(name)
                usage[salt] = usage.get(salt, 0) - size
                used -= size
        return [n for n in chosen if owner(n, live) == me]


__all__ = ["Change", "FleetEntry", "FleetView", "key_of", "owner", "salt_of"]
