"""What the fleet reads from ``_fleet/`` is untrusted input: bounded, then checked field by field.

Any process that can write to the prefix can put anything there: a stray file, an object of
another format, a zlib bomb. So a fleet object is refused (:class:`BadObject`) unless it is small
enough in the store (:data:`MAX_STORED`, checked from the listing before any read where the
listing says the size), inflates to at most :data:`MAX_DECODED` bytes (decompressed in bounded
steps: a bomb costs at most that much memory, once), is JSON of the expected kind and format, and
every field has the expected type and range. A body that passes is normalized (ints, finite
floats, strings), so folding it can no longer fail half-way. The caller skips and quarantines
what is refused (:mod:`.quarantine`); nothing here raises anything but :class:`BadObject`.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

FORMAT = 1

#: The largest fleet object read, in the store, by kind. A journal is one round's records of one
#: node (the writer splits bigger batches, :data:`JOURNAL_MAX_RECORDS`), a digest the rows touched
#: since the last snapshot (a snapshot is written past 20,000), a snapshot the whole index.
MAX_STORED = {"journal": 16 << 20, "digest": 64 << 20, "snapshot": 256 << 20}
#: ... and once inflated: a snapshot of 512 MiB holds about three million chunks.
MAX_DECODED = {"journal": 32 << 20, "digest": 256 << 20, "snapshot": 512 << 20}
#: A journal holds at most this many records (about 22 MB with 1 KiB names): a node with more
#: buffered writes several journals in one round.
JOURNAL_MAX_RECORDS = 20_000
_MAX_INT = 1 << 62
_MAX_STR = 1024


class BadObject(ValueError):
    """A fleet object that is too big, does not inflate, or is not of the expected kind, format or
    shape. The message says which and why (never the object's bytes)."""


def inflate(kind: str, data: bytes) -> bytes:
    """Decompress ``data`` (zlib), refusing more than ``MAX_DECODED[kind]`` bytes of output."""
    if len(data) > MAX_STORED[kind]:
        raise BadObject(f"{len(data)} bytes, more than a fleet {kind} may hold ({MAX_STORED[kind]})")
    limit = MAX_DECODED[kind]
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise BadObject(f"not a fleet {kind} object: {e}") from None
    if len(out) > limit:
        raise BadObject(f"inflates past {limit} bytes, more than a fleet {kind} may hold")
    if not d.eof:
        raise BadObject(f"not a fleet {kind} object: truncated zlib stream")
    return out


def decode(kind: str, data: bytes) -> dict[str, Any]:
    """A fleet object's JSON body (bounded: :func:`inflate`); BadObject unless it is of ``kind``
    in a known format."""
    raw = inflate(kind, bytes(data))
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BadObject(f"not a fleet {kind} object: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != FORMAT or obj.get("kind") != kind:
        raise BadObject(f"not a fleet {kind} object of format {FORMAT}")
    return obj


# ---- field checks ------------------------------------------------------------------------------
def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not -_MAX_INT <= v <= _MAX_INT:
        raise BadObject(f"{what}: not an integer in range")
    return v


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or abs(v) > 1e12:
        raise BadObject(f"{what}: not a finite number")
    return float(v)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) > _MAX_STR:
        raise BadObject(f"{what}: not a string of at most {_MAX_STR} characters")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise BadObject(f"{what}: not a list")
    return v


def _row(v: Any, n: int, what: str) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise BadObject(f"{what}: not a row of {n} fields")
    return v


def _map(obj: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    m = obj.get(field, {})
    if not isinstance(m, dict):
        raise BadObject(f"{field}: not an object")
    return {_str(k, field): value(v, field) for k, v in m.items()}


def _rows(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``e`` (entry) and ``tomb`` rows of a snapshot or digest, normalized."""
    rows = (_row(r, 5, "e") for r in _list(obj.get("e", []), "e"))
    entries = [(_str(seg, "e"), _int(size, "e"), _num(stored, "e"), _num(accessed, "e"), _str(writer, "e"))
               for seg, size, stored, accessed, writer in rows]
    tombs = [(_str(seg, "tomb"), _num(t, "tomb")) for seg, t in
             (_row(r, 2, "tomb") for r in _list(obj.get("tomb", []), "tomb"))]
    return {"e": entries, "tomb": tombs}


def read_journal(data: bytes) -> dict[str, Any]:
    """A journal's body: ``r`` as (op, segment, size, time) records; ``t`` (the writer's clock
    when it wrote it) and ``cap`` (its capacity in bytes) when the writer sent them."""
    obj = decode("journal", data)
    recs = [(_str(op, "r"), _str(seg, "r"), _int(size, "r"), _num(t, "r"))
            for op, seg, size, t in (_row(r, 4, "r") for r in _list(obj.get("r"), "r"))]
    body: dict[str, Any] = {"node": _str(obj.get("node"), "node"), "seq": _int(obj.get("seq"), "seq"),
                            "r": recs}
    if "t" in obj:
        body["t"] = _num(obj["t"], "t")
    if "cap" in obj:
        body["cap"] = _int(obj["cap"], "cap")
    return body


def read_snapshot(data: bytes) -> dict[str, Any]:
    obj = decode("snapshot", data)
    return {"gen": _int(obj.get("gen"), "gen"), "node": _str(obj.get("node", ""), "node"),
            "t": _num(obj.get("t", 0.0), "t"), "reconciled": _num(obj.get("reconciled", 0.0), "reconciled"),
            "marks": _map(obj, "marks", _int), **_rows(obj)}


def read_digest(data: bytes) -> dict[str, Any]:
    """A digest's body. ``seen`` holds the compactor's wall-clock times (older writers); ``ages``
    seconds since it saw each node make progress, on its own clock; ``caps`` each node's capacity;
    ``w`` when it wrote the digest (its clock: only to warn of skew)."""
    obj = decode("digest", data)
    body = {"gen": _int(obj.get("gen"), "gen"), "snode": _str(obj.get("snode"), "snode"),
            "t": _num(obj.get("t"), "t"), "node": _str(obj.get("node", ""), "node"),
            "marks": _map(obj, "marks", _int), "seen": _map(obj, "seen", _num),
            "ages": _map(obj, "ages", _num), "caps": _map(obj, "caps", _int), **_rows(obj)}
    if "w" in obj:
        body["w"] = _num(obj["w"], "w")
    return body


__all__ = ["FORMAT", "JOURNAL_MAX_RECORDS", "MAX_DECODED", "MAX_STORED", "BadObject", "decode", "inflate",
           "read_digest", "read_journal", "read_snapshot"]
