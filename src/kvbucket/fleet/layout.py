"""Where the fleet keeps its shared state in the bucket, and how those objects are encoded.

Everything lives under ``<prefix>/_fleet/``. A cache key is encoded into ONE name segment
(:func:`kvbucket.keys.key_to_name`), so a name with a ``/`` below the prefix can never be a
key: no key collides with the fleet's objects, and key listings skip them.

- ``_fleet/j/<node>/<seq>``: a journal, an immutable batch of records one node wrote
  (``seq`` counts up from 1 per node; written once, deleted after compaction);
- ``_fleet/s/<gen>-<node>``: an index snapshot, the folded state of every journal up to the
  per-node marks it holds (the newest ``gen`` wins; the two newest are kept);
- ``_fleet/n/<node>``: a heartbeat, rewritten every ``heartbeat_secs`` when the node wrote no
  journal meanwhile (a journal's mtime says alive as well);
- ``_fleet/d``: the digest, overwritten by the compactor: which snapshot is current, every chunk
  touched since it (as rows), the journal marks folded and the nodes seen. The other nodes read
  only this object each round, with a conditional GET.

Bodies are zlib-compressed JSON with a format version; what is read back is untrusted and
checked by :mod:`.wire` (anything else is refused on read), and so are listed names here: a name
the fleet could not have written (a node id of other characters, an absurd sequence number) is
not a fleet object at all.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from kvbucket.fleet.wire import FORMAT, read_journal
from kvbucket.stores.base import ObjectStore

FLEET_DIR = "_fleet"
#: A node id (FleetConfig.node_id's rule) and the largest journal seq or snapshot generation.
_NODE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_SEQ = 10**15

#: A journal record: (op, key segment, size, wall-clock time). op: "s" stored, "d" deleted,
#: "a" accessed (size 0).
Record = tuple[str, str, int, float]


def fleet_root(prefix: str) -> str:
    return f"{prefix}/{FLEET_DIR}" if prefix else FLEET_DIR


def is_fleet_name(name: str, prefix: str) -> bool:
    return name.startswith(fleet_root(prefix) + "/")


def journal_name(prefix: str, node: str, seq: int) -> str:
    return f"{fleet_root(prefix)}/j/{node}/{seq:012d}"


def snapshot_name(prefix: str, gen: int, node: str) -> str:
    return f"{fleet_root(prefix)}/s/{gen:012d}-{node}"


def digest_name(prefix: str) -> str:
    return f"{fleet_root(prefix)}/d"


def heartbeat_name(prefix: str, node: str) -> str:
    return f"{fleet_root(prefix)}/n/{node}"


@dataclass(frozen=True, slots=True)
class Parsed:
    kind: str  # "j", "s", "n", "d"
    node: str
    seq: int = 0  # journal seq or snapshot gen


def parse_name(name: str, prefix: str) -> Parsed | None:
    """What a listed ``_fleet/`` object is, or None for anything the fleet did not write."""
    root = fleet_root(prefix) + "/"
    if not name.startswith(root):
        return None
    parts = name[len(root) :].split("/")
    if parts == ["d"]:
        return Parsed("d", "")
    if parts[0] == "j" and len(parts) == 3:
        node, num = parts[1], parts[2]
    elif parts[0] == "s" and len(parts) == 2:
        num, _, node = parts[1].partition("-")
    elif parts[0] == "n" and len(parts) == 2:
        node, num = parts[1], "0"
    else:
        return None
    if not _NODE_RE.match(node) or not num.isascii() or not num.isdigit() or len(num) > 15:
        return None
    return Parsed(parts[0], node, int(num))


@dataclass(slots=True)
class Listing:
    """One listing of ``_fleet/``: what the fleet wrote there (by :func:`parse_name`), by kind."""

    journals: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # node -> [(seq, name)]
    snapshots: list[tuple[int, str, str, int]] = field(default_factory=list)  # (gen, node, name, size)
    sizes: dict[str, int] = field(default_factory=dict)  # journal name -> size
    #: node -> newest mtime of its journals and heartbeat (the store's clock, or the writer's)
    seen: dict[str, float] = field(default_factory=dict)
    beats: dict[str, tuple[float | None, int]] = field(default_factory=dict)  # node -> (mtime, size)
    pages: int = 0  # listing requests it took
    at: float = 0.0  # this node's clock when the listing started


def list_fleet(store: ObjectStore, prefix: str) -> Listing:
    """List ``_fleet/`` once; names the fleet could not have written are left out. A node's time
    is its newest object's mtime (now when the store gives none)."""
    now = time.time()
    out = Listing(at=now)
    for i, info in enumerate(store.list(fleet_root(prefix) + "/")):
        if i % 1000 == 0:
            out.pages += 1
        p = parse_name(info.name, prefix)
        if p is None:
            continue
        seen = info.mtime if info.mtime is not None else now
        if p.kind in ("j", "n"):
            out.seen[p.node] = max(out.seen.get(p.node, 0.0), seen)
        if p.kind == "j":
            out.journals.setdefault(p.node, []).append((p.seq, info.name))
            out.sizes[info.name] = info.size
        elif p.kind == "s":
            out.snapshots.append((p.seq, p.node, info.name, info.size))
        elif p.kind == "n":
            out.beats[p.node] = (info.mtime, info.size)
    out.pages = max(1, out.pages)
    return out


def encode(kind: str, body: dict[str, Any], level: int = 1) -> bytes:
    data = json.dumps({"v": FORMAT, "kind": kind, **body}, separators=(",", ":")).encode()
    return zlib.compress(data, level)


@dataclass(slots=True)
class Journal:
    """One node's records of a round. ``t``: the writer's clock when it wrote the journal (the
    compactor compares it with its own to warn of skew); ``cap``: the writer's capacity in bytes
    (to warn when nodes disagree). Both are None from writers that did not send them."""

    node: str
    seq: int
    records: list[Record] = field(default_factory=list)
    t: float | None = None
    cap: int | None = None

    def to_bytes(self) -> bytes:
        extra = {k: v for k, v in (("t", self.t), ("cap", self.cap)) if v is not None}
        return encode("journal", {"node": self.node, "seq": self.seq, "r": self.records, **extra})

    @classmethod
    def from_bytes(cls, data: bytes) -> Journal:
        """:class:`~kvbucket.fleet.wire.BadObject` (a ValueError) unless ``data`` is a journal."""
        obj = read_journal(data)
        return cls(obj["node"], obj["seq"], obj["r"], obj.get("t"), obj.get("cap"))


__all__ = [
    "FLEET_DIR",
    "MAX_SEQ",
    "Journal",
    "Listing",
    "Parsed",
    "Record",
    "digest_name",
    "encode",
    "fleet_root",
    "heartbeat_name",
    "is_fleet_name",
    "journal_name",
    "list_fleet",
    "parse_name",
    "snapshot_name",
]
