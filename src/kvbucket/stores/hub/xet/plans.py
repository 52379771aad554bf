"""What a Xet read fetches: reconstructions (whole, or in parts for a big object) as ranged GETs.

A reconstruction answer (``GET {cas}/v1/reconstructions/{file_hash}``, optionally with
``Range: bytes=a-b`` for part of the file) lists terms (chunk ranges of xorbs, in file order)
and where to fetch each xorb's chunks (``fetch_info``: presigned URL, chunk range, end-inclusive
byte range). A part's first term starts at the chunk holding byte ``a`` (``offset_into_first_range``
into it) and its last term ends with the chunk holding byte ``b``: neighbouring parts share the
chunk their boundary falls in.

Why parts: one GET rides one connection, and a real link caps each connection (object stores
and CDNs at ~100 MB/s); an object of tens of MiB read with one GET takes its size over one
connection's cap however fast the link. Read in parts, each a reconstruction of its own range
(asked all at once, like every object's), its fetches run in parallel.

Why smaller parts for a small load: a load is as fast as the fetches it keeps in flight, so when
its objects, in parts of ``read_part_bytes``, would be fewer fetches than ``read_connections``,
they are read in parts of ``bytes / read_connections``, but not below ``read_min_part_bytes``
(:data:`MIN_PART_BYTES`; the rule is :func:`kvbucket.stores.part_sizes.part_size`, shared with S3).
Why a floor: each part is a reconstruction request to the CAS server and a fetch, and two parts
share the chunk their boundary falls in (fetched by both).

Why off (0) by default: smaller parts pay only while the link's per-connection cap, not the
client, bounds the load. Measured (bench_latency, fresh processes, kvbucket against itself with
the floor off in the same runs, rounds alternated, a 2-core machine shared at load 2-19; medians
of per-round ratios, > 1: the floor faster): through a link capping each connection at 8 MB/s,
16 x 8 MiB in 64 parts of 2 MiB 1.21-1.71x (floors 2 and 1 MiB, 0 and 20 ms), but 32 x 2 MiB in
1 MiB parts 0.88-0.98x (10 rounds); at 32 MB/s per connection (20 ms) 0.72x and 0.75x; on
loopback 0.66-0.88x and 0.75-0.80x. Each part costs the client ~3 ms of CPU (a request, a
reconstruction, a body read by one more thread: 0.35-0.41 s against 0.23-0.24 s per 16 x 8 MiB
load), so once connections x cap exceed what the client decodes, more of them only cost; object
stores cap a connection at ~100 MB/s. Set it (2 MiB measured best) where connections are capped
far lower. See docs/hfbucket.md, "What bounds a hit on a real link".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from kvbucket.errors import StoreError
from kvbucket.stores.hub.xet.decode import XetReadUnsupported
from kvbucket.stores.part_sizes import part_ranges

#: Parts never get smaller than this to fill the read budget (``read_min_part_bytes``; 0, the
#: default: parts of ``read_part_bytes`` only). Measured: the module's docstring.
MIN_PART_BYTES = 0

#: Fetch URLs are presigned and expire (an hour on the Hub today); a reconstruction is reused
#: for at most this long, and one whose fetch is refused is asked for again once.
RECONSTRUCTION_TTL_SECS = 60.0


@dataclass(frozen=True, slots=True)
class Fetch:
    url: str
    first: int  # first byte (inclusive) and last byte (inclusive) of the ranged GET
    last: int
    chunk_start: int  # chunks [chunk_start, chunk_end) of the xorb that the range holds
    chunk_end: int
    #: the terms this range serves: (first chunk, end chunk (excl.), offset in the file, length)
    targets: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Reconstruction:
    fetches: tuple[Fetch, ...]
    size: int
    expires: float
    #: Of an object read in parts: the part of each fetch, and per part ``(a, b, begin, end)``: the
    #: range asked for and the bytes it writes (after the cut, join_parts). Empty otherwise.
    owners: tuple[int, ...] = ()
    parts: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _Term:
    key: tuple[str, int]  # (xorb, index of the fetch_info entry that covers it)
    cs: int
    ce: int
    offset: int  # where its bytes start in the file
    length: int


@dataclass(slots=True)
class Part:
    """One reconstruction answer: its terms placed in the file, from ``begin`` to ``end``."""

    begin: int
    end: int
    terms: list[_Term]
    infos: dict[str, Any]


def parse_part(body: dict[str, Any], start: int) -> Part:
    """The terms of a reconstruction answer for a range starting at byte ``start``, placed.

    A shape this reader does not know (fields missing or of other types) is
    :class:`XetReadUnsupported` (hf_xet reads it instead); values no reconstruction can hold (a
    negative length or offset, an empty or reversed range, a fetch that does not cover its
    chunks) are the server's error: a ``StoreError``, never a bare ``ValueError``."""
    if not isinstance(body, dict):
        raise StoreError(f"the storage answered a reconstruction with {type(body).__name__}, not an object")
    try:
        skip = _count(body.get("offset_into_first_range", 0), "offset_into_first_range")
        if skip > start:
            raise StoreError(f"a reconstruction starts {skip} bytes before byte {start} of its file")
        infos = body["fetch_info"]
        offset = begin = start - skip
        terms = []
        for term in body["terms"]:
            xorb, cs, ce = str(term["hash"]), _count(term["range"]["start"]), _count(term["range"]["end"])
            length = _count(term["unpacked_length"], "unpacked_length")
            if ce <= cs:
                raise StoreError(f"the reconstruction names an empty chunk range {cs}-{ce} of xorb {xorb}")
            k = next((i for i, fi in enumerate(infos[xorb])
                      if _count(fi["range"]["start"]) <= cs and ce <= _count(fi["range"]["end"])), None)
            if k is None:
                raise XetReadUnsupported(f"no fetch covers chunks {cs}-{ce} of xorb {xorb}")
            terms.append(_Term((xorb, k), cs, ce, offset, length))
            offset += length
        return Part(begin, offset, terms, infos)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise XetReadUnsupported(f"unexpected reconstruction answer: {e!r}") from None


def _count(value: Any, what: str = "chunk or byte position") -> int:
    """A reconstruction's number: an int >= 0 (JSON has no other kind of length or position)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreError(f"the reconstruction's {what} is {value!r}, not a whole number")
    if value < 0:
        raise StoreError(f"the reconstruction's {what} is negative ({value})")
    return value


def parse_reconstruction(body: dict[str, Any], size: int, now: float) -> Reconstruction:
    """The fetches that rebuild a whole file of ``size`` bytes from a v1 reconstruction answer."""
    if isinstance(body, dict) and _count(body.get("offset_into_first_range", 0), "offset_into_first_range"):
        raise XetReadUnsupported("a whole-file reconstruction starting inside its first range")
    return join_parts([parse_part(body, 0)], size, now)


def join_parts(parts: list[Part], size: int, now: float,
               asked: list[tuple[int, int]] | None = None) -> Reconstruction:
    """The fetches of a file read in ``parts`` (in file order), each writing its own bytes.

    **Invariant (the parts of an object write disjoint ranges that tile it).** The first part
    starts at byte 0, the last ends at ``size``, and each starts where the one before ends or
    inside its last term (the chunk their boundary falls in, which both were sent): that chunk is
    left to the later part, the earlier one's last term cut by exactly the overlap. Each term
    still counts its chunks' decoded bytes against its (cut) length (``copy_range``), so a cut
    that is not exactly the shared chunk fails the read instead of writing a wrong byte; no byte
    of the object is written by two fetches, none by no fetch.
    """
    if not parts or parts[0].begin != 0 or parts[-1].end != size:
        got = f"{parts[0].begin}-{parts[-1].end}" if parts else "nothing"
        raise StoreError(f"the reconstruction describes bytes {got} of a file of {size}")
    for a, b in itertools.pairwise(parts):
        _cut(a, b.begin)
    fetches: list[Fetch] = []
    owners: list[int] = []
    for k, p in enumerate(parts):
        mine = _fetches(p)
        fetches += mine
        owners += [k] * len(mine)
    if asked is None or len(parts) < 2 or len(asked) != len(parts):
        return Reconstruction(tuple(fetches), size, now + RECONSTRUCTION_TTL_SECS)
    spans = tuple((a, b, p.begin, p.end) for (a, b), p in zip(asked, parts, strict=True))
    return Reconstruction(tuple(fetches), size, now + RECONSTRUCTION_TTL_SECS, tuple(owners), spans)


def replan_part(rec: Reconstruction, k: int, part: Part) -> tuple[Fetch, ...]:
    """The fetches of part ``k`` of ``rec`` from a fresh answer for its range (its fetch URLs were
    refused: expired). Same invariant as :func:`join_parts`: the fresh part must begin where the
    old one did and is cut where it ended, so it writes exactly the bytes the old one wrote."""
    _, _, begin, end = rec.parts[k]
    if part.begin != begin:
        raise StoreError(f"a part's fresh reconstruction starts at byte {part.begin}, not {begin}")
    _cut(part, end)
    if part.end != end:
        raise StoreError(f"a part's fresh reconstruction ends at byte {part.end}, not {end}")
    return tuple(_fetches(part))


def _cut(a: Part, end: int) -> None:
    """Cut part ``a`` to end at ``end`` (the next part's begin: inside ``a``'s last chunk)."""
    over = a.end - end
    last = a.terms[-1] if a.terms else None
    if over < 0 or (over and (last is None or over > last.length)):
        raise StoreError(f"the parts of a reconstruction do not meet (bytes {a.end} and {end})")
    if over:
        assert last is not None
        a.terms[-1] = replace(last, ce=last.ce - 1, length=last.length - over)
        a.end = end


def _fetches(p: Part) -> list[Fetch]:
    """The ranged GETs of one part: one per xorb fetch range its terms use."""
    plan: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
    for t in p.terms:
        if t.length or t.ce > t.cs:
            plan.setdefault(t.key, []).append((t.cs, t.ce, t.offset, t.length))
    out = []
    try:
        for (xorb, k), targets in plan.items():
            fi = p.infos[xorb][k]
            first, last = _count(fi["url_range"]["start"]), _count(fi["url_range"]["end"])
            if last < first:
                raise StoreError(f"the reconstruction's byte range {first}-{last} of xorb {xorb} is reversed")
            out.append(Fetch(str(fi["url"]), first, last, _count(fi["range"]["start"]),
                             _count(fi["range"]["end"]), tuple(targets)))
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise XetReadUnsupported(f"unexpected reconstruction answer: {e!r}") from None
    return out


__all__ = ["MIN_PART_BYTES", "RECONSTRUCTION_TTL_SECS", "Fetch", "Part", "Reconstruction", "join_parts",
           "parse_part", "parse_reconstruction", "part_ranges", "replan_part"]
