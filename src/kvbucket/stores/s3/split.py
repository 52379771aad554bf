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

The rule itself (:func:`kvbucket.stores.part_sizes.part_size`) is shared with the Hub's reads, whose
floor was measured on its own (``read_min_part_bytes``: stores/hub/xet/plans.py).
"""

from __future__ import annotations

from kvbucket.stores.part_sizes import part_size  # the rule, shared with the Hub's reads

#: Parts never get smaller than this to fill the connection budget (``s3_read_min_part_bytes``).
MIN_PART_BYTES = 2 << 20


__all__ = ["MIN_PART_BYTES", "part_size"]
