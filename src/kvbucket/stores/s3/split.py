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
"""

from __future__ import annotations

from collections.abc import Sequence

#: Parts never get smaller than this to fill the connection budget (``s3_read_min_part_bytes``).
MIN_PART_BYTES = 2 << 20


def part_size(sizes: Sequence[int], budget: int, part_bytes: int, min_part_bytes: int) -> int:
    """The part size of a load of objects of ``sizes`` (those that can be split) with ``budget``
    GETs in flight at once: ``part_bytes`` when the load's bytes fill the budget with parts that
    big, else ``bytes / budget`` but not below ``min_part_bytes``; 0: never split."""
    if part_bytes <= 0:
        return 0
    total = sum(sizes)
    if min_part_bytes <= 0 or min_part_bytes >= part_bytes or total <= 0:
        return part_bytes
    return min(part_bytes, max(min_part_bytes, -(-total // max(1, budget))))


__all__ = ["MIN_PART_BYTES", "part_size"]
