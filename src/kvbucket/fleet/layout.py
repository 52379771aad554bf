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

Bodies are zlib-compressed JSON with a format version; anything else is refused on read.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

FLEET_DIR = "_fleet"
FORMAT = 1

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
    try:
        if parts[0] == "j" and len(parts) == 3:
            return Parsed("j", parts[1], int(parts[2]))
        if parts[0] == "s" and len(parts) == 2:
            gen, _, node = parts[1].partition("-")
            return Parsed("s", node, int(gen)) if node else None
        if parts[0] == "n" and len(parts) == 2:
            return Parsed("n", parts[1])
        if parts == ["d"]:
            return Parsed("d", "")
    except ValueError:
        return None
    return None


def encode(kind: str, body: dict[str, Any], level: int = 1) -> bytes:
    data = json.dumps({"v": FORMAT, "kind": kind, **body}, separators=(",", ":")).encode()
    return zlib.compress(data, level)


def decode(kind: str, data: bytes) -> dict[str, Any]:
    """Decode a fleet object; ValueError when it is not one of ``kind`` in a known format."""
    try:
        obj = json.loads(zlib.decompress(data))
    except (zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a fleet {kind} object: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != FORMAT or obj.get("kind") != kind:
        raise ValueError(f"not a fleet {kind} object of format {FORMAT}")
    return obj


@dataclass(slots=True)
class Journal:
    node: str
    seq: int
    records: list[Record] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return encode("journal", {"node": self.node, "seq": self.seq, "r": self.records})

    @classmethod
    def from_bytes(cls, data: bytes) -> Journal:
        obj = decode("journal", data)
        recs = [(str(op), str(seg), int(size), float(t)) for op, seg, size, t in obj["r"]]
        return cls(str(obj["node"]), int(obj["seq"]), recs)


__all__ = [
    "FLEET_DIR",
    "Journal",
    "Parsed",
    "Record",
    "decode",
    "digest_name",
    "encode",
    "fleet_root",
    "heartbeat_name",
    "is_fleet_name",
    "journal_name",
    "parse_name",
    "snapshot_name",
]
