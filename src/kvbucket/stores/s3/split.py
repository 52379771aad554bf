"""How many ranged GETs each object of a direct S3 load is read with (stores/s3/direct.py).

Why: a real link caps each connection (S3 at ~100 MB/s), so a load is as fast as the number of
GETs it keeps in flight; that number should follow the connection budget (``s3_num_io_threads``),
not the object count. Objects of at least twice ``s3_read_part_bytes`` are always read in parts of
about that size (as awscrt does); when that still leaves fewer ranges than the budget, parts get
smaller, down to ``s3_read_min_part_bytes``, until about the budget is in flight: with a budget of
64, 16 x 8 MiB is 64 ranges of 2 MiB, 8 x 32 MiB 64 of 4 MiB, and 32 x 2 MiB or 64 x 2 MiB stay one
GET each (below two parts of the floor).

Why a floor, and why 2 MiB: a range is a request (a round trip to its first byte, headers, a
Content-Range check, a libcurl transfer, and the server's own work). Measured through a link
capping each connection at 8 MB/s (20 ms): 16 x 8 MiB in 2 MiB ranges 1.71x as fast as one GET
each, 8 x 32 MiB in 4 MiB ranges 1.38x as fast as in 8 MiB ones, but 32 x 2 MiB in 1 MiB ranges
0.76-0.88x (slower: the extra requests cost more CPU than the shorter transfers saved, on a
2-core machine running the relay and the server too). On loopback at 0 ms the 2 MiB ranges of
16 x 8 MiB were within noise of one GET each. See docs/s3.md, "What bounds a hit on a real link".

Ranges joined (:func:`join_ranges`) only when all carry one ETag: a server (or proxy) giving
ranges none makes each split object a second, whole GET, so the reader stops splitting then.

The rule itself (:func:`kvbucket.stores.part_sizes.part_size`) is shared with the Hub's reads, whose
floor was measured on its own (``read_min_part_bytes``: stores/hub/xet/plans.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvbucket.stores.part_sizes import part_size  # the rule, shared with the Hub's reads
from kvbucket.stores.s3.kept import OVERLONG
from kvbucket.stores.s3.transfers import CLOSED, EXPIRED, MISSING, RETRY, UNANSWERED, Body, Outcome, WrongSize

#: Parts never get smaller than this to fill the connection budget (``s3_read_min_part_bytes``).
MIN_PART_BYTES = 2 << 20


def join_ranges(got: Sequence[Outcome], owner: Sequence[int], buffers: Sequence[Any | None],
                split: Any) -> tuple[list[Outcome], int, int]:
    """One outcome per object (see DirectReader.fetch), how many were of mixed versions and how
    many had no ETag on any range: an object read in ranges is read when every range was, all of
    one ETag; otherwise it is the wrong size, missing, or repeated whole by obstore."""
    parts: list[list[Outcome]] = [[] for _ in buffers]
    for i, o in zip(owner, got, strict=True):
        parts[i].append(o)
    out: list[Outcome] = []
    mixed = untagged = 0
    for i, ps in enumerate(parts):
        if i not in split:
            out.append(ps[0])  # one GET
        elif all(isinstance(p, Body) for p in ps):
            tags = {p.etag for p in ps if isinstance(p, Body)}
            if len(tags) != 1 or None in tags:  # not provably one version: one GET, one version
                untagged += tags == {None}  # the server (or a proxy) gives ranges no ETag
                mixed += tags != {None}
                out.append(RETRY)
                continue
            out.append(Body(sum(p.size for p in ps if isinstance(p, Body)), buffers[i]))
        else:  # the wrong size, missing, out of time (no obstore retry then), or repeated whole
            sized = [p for p in ps if isinstance(p, WrongSize)]
            why = [w for w in (OVERLONG, MISSING, UNANSWERED, EXPIRED, CLOSED) if w in ps]
            out.append(sized[0] if sized else why[0] if why else RETRY)
    return out, mixed, untagged


def where(url: str) -> str:
    """The scheme, host and port of a presigned URL: never its path or query (signature, key id)."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname}" + (f":{u.port}" if u.port else "")


__all__ = ["MIN_PART_BYTES", "join_ranges", "part_size", "where"]
