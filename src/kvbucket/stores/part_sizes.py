"""The smallest part a store reads an object in (``s3_read_part_bytes``, ``s3_read_min_part_bytes``,
the Hub's ``read_part_bytes``).

Why a floor: every part is a request, and the plan of an object's parts is built before the
first one is sent. Parts of 1 byte made one 8 MiB load build 8 million ranges (~3 GB, 14 s past
a 5 s budget) and 4096-byte parts sent 534 GETs for 2 MiB (issue 41's outside tester). 64 KiB
keeps a 32 MiB chunk at 512 requests at most; real settings are MiBs.
"""

from __future__ import annotations

from typing import Any

#: A part size is 0 (off) or at least this (64 KiB).
MIN_PART_FLOOR = 64 << 10
#: ... and at most this (1 TiB).
MAX_PART_BYTES = 1 << 40


def check_part_bytes(key: str, value: Any, echo: bool = True) -> int:
    """``value`` if it is 0 or an int from :data:`MIN_PART_FLOOR` to :data:`MAX_PART_BYTES`,
    else a ValueError naming ``key``, the value (``echo``: where the caller's message does not
    already) and the allowed range (booleans refused)."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (value == 0 or MIN_PART_FLOOR <= value <= MAX_PART_BYTES):
        return int(value)
    raise ValueError(f"{key} must be 0 (off) or a whole number of bytes from {MIN_PART_FLOOR} (64 KiB) "
                     f"to {MAX_PART_BYTES} (1 TiB)" + (f", got {value!r}" if echo else ""))


__all__ = ["MAX_PART_BYTES", "MIN_PART_FLOOR", "check_part_bytes"]
