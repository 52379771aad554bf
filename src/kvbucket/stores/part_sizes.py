"""How a store cuts an object into parts read in parallel: the ranges (:func:`part_ranges`), the
part size a load's connection budget asks for (:func:`part_size`), and the sizes a setting may
name (``s3_read_part_bytes``, ``s3_read_min_part_bytes``, the Hub's ``read_part_bytes`` and
``read_min_part_bytes``: :func:`check_part_bytes`, the one parser of all four, wherever they are
set). Shared by the Hub's and S3's ranged reads.

Why a floor: every part is a request, and the plan of an object's parts is built before the
first one is sent. Parts of 1 byte made one 8 MiB load build 8 million ranges (~3 GB, 14 s past
a 5 s budget) and 4096-byte parts sent 534 GETs for 2 MiB (issue 41's outside tester). 64 KiB
keeps a 32 MiB chunk at 512 requests at most; real settings are MiBs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A part size is 0 (off) or at least this (64 KiB).
MIN_PART_FLOOR = 64 << 10
#: ... and at most this (1 TiB).
MAX_PART_BYTES = 1 << 40
#: Every part-size setting: parsed by :func:`check_part_bytes` alone (the lenient number parsing of
#: plugin options leaves them to it, so each is spelt and refused in the same words everywhere).
PART_SIZE_KEYS = frozenset({"s3_read_part_bytes", "s3_read_min_part_bytes", "read_part_bytes",
                            "read_min_part_bytes"})


def _whole(value: Any) -> int | None:
    """``value`` as LMCache 0.5.6 reads an int setting (``int(value)``: its config's
    ``env_converter`` and ``int(extra_config.get(...))``): an int, a string Python's ``int``
    parses (``"1_048_576"``, ``" 8388608 "``) or a float; None for anything else. Stricter than
    ``int()`` where it would silently change the value: a fractional float (``8388608.5``) and a
    boolean (``True`` was 1 byte: 8 million ranges for 8 MiB) are refused."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def check_part_bytes(key: str, value: Any, echo: bool = True) -> int:
    """``value`` (any spelling :func:`_whole` takes) if it is 0 or from :data:`MIN_PART_FLOOR` to
    :data:`MAX_PART_BYTES`, else a ValueError naming ``key`` (empty where the caller's message
    names the setting already, as a config model's errors do), the value (``echo``: where the
    caller's message does not already) and the allowed range. The one parser of every part-size
    setting (:data:`PART_SIZE_KEYS`): an outside tester found the S3 ones taking ``8388608.0`` and
    refusing ``"1_048_576"``, the Hub plugin's the opposite."""
    n = _whole(value)
    if n is not None and (n == 0 or MIN_PART_FLOOR <= n <= MAX_PART_BYTES):
        return n
    named = f"{key} " if key else ""
    raise ValueError(f"{named}must be 0 (off) or a whole number of bytes from {MIN_PART_FLOOR} (64 KiB) "
                     f"to {MAX_PART_BYTES} (1 TiB)" + (f", got {value!r}" if echo else ""))


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of about ``part_bytes`` tiling an object of ``size`` bytes, for a read of
    one object into its buffer in parallel parts; one range for an object below two parts (or
    ``part_bytes`` 0: never split). Shared by the Hub's and S3's ranged reads."""
    k = size // part_bytes if part_bytes > 0 else 1
    if k < 2:
        return [(0, size)]
    return [(i * size // k, (i + 1) * size // k) for i in range(k)]


def part_floor(part_bytes: int, min_part_bytes: int) -> int:
    """The smallest part a load may read (``min_part_bytes``, or ``part_bytes`` without a floor):
    an object below twice this is always one read."""
    return min(min_part_bytes or part_bytes, part_bytes)


def part_size(sizes: Sequence[int], budget: int, part_bytes: int, min_part_bytes: int) -> int:
    """The part size of a load of objects of ``sizes`` with ``budget`` ranged reads in flight at
    once (for :func:`part_ranges`); 0: never split. Shared by the Hub's and S3's reads (the
    measurements behind each family's floor: ``s3/split.py``, ``hub/xet/plans.py``).

    **Invariant (a load's reads fill the budget, none below the floor).** An object below twice
    :func:`part_floor` is one read and takes one connection of the budget; the others are read in
    parts of ``part_bytes`` when those fill what is left of the budget, else of ``bytes / budget``
    but never below ``min_part_bytes``: so a load of few objects keeps about ``budget`` reads in
    flight (a real link caps each connection), and no part is so small that its request costs more
    than its transfer. ``min_part_bytes`` 0: parts of ``part_bytes`` only."""
    if part_bytes <= 0:
        return 0
    floor = part_floor(part_bytes, min_part_bytes)
    split = [s for s in sizes if s >= 2 * floor]
    total = sum(split)
    if min_part_bytes <= 0 or min_part_bytes >= part_bytes or total <= 0:
        return part_bytes
    budget -= len(sizes) - len(split)  # the objects read whole
    return min(part_bytes, max(min_part_bytes, -(-total // max(1, budget))))


__all__ = ["MAX_PART_BYTES", "MIN_PART_FLOOR", "PART_SIZE_KEYS", "check_part_bytes", "part_floor",
           "part_ranges", "part_size"]
