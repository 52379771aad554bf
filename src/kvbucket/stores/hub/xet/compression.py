"""Which compression policy a batch of Hub uploads goes up with: skip hf_xet's attempts on bytes
that cannot compress.

Why: hf_xet's ``auto`` policy runs its byte-grouping predictor and an LZ4 attempt on every
chunk, and keeps the attempt only when it is smaller. On bytes that never compress (random
bytes, ciphertext: every object of an encrypted store) that is CPU spent for nothing, on the
threads that also chunk and hash: measured in LMCache's runner (``bench_l2.py --backends hfbucket
--payloads random``, 64 x 2 MiB, two runs per side alternated), the store was 1.19-1.23x
LMCache's adapter with ``none`` against 1.12x with hf_xet's ``auto`` (docs/hfbucket.md).

So with the ``auto`` setting a batch is sampled first: :data:`SAMPLED_OBJECTS` of its objects
(first, middle, last), :data:`SAMPLE_BYTES` from the middle of each payload, compressed as
hf_xet would (LZ4 alone and after byte grouping 4). Only if no sample shrinks below
:data:`INCOMPRESSIBLE` of its size does the batch go up with ``none``; otherwise hf_xet's
``auto`` decides per chunk, as before. A wrong guess costs bytes on the wire (a batch whose
unsampled objects would have compressed goes up raw), never correctness: every chunk names its
own scheme and the reader decodes each (xet_decode).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvbucket.stores.base import Gather

#: Bytes read from the middle of each sampled object: a few of Xet's 64 KiB chunks.
SAMPLE_BYTES = 128 << 10
#: Objects sampled per batch (first, middle, last): a batch of KV chunks is one layout.
SAMPLED_OBJECTS = 3
#: A sample compressed to at least this fraction of its size does not compress: random bytes
#: and ciphertext come out at 1.004 under LZ4; bf16 KV at 0.87-0.90 after byte grouping.
INCOMPRESSIBLE = 0.99
#: Below this an object is not sampled (a batch of them is left to hf_xet's ``auto``).
MIN_SAMPLE = 16 << 10

_POLICY_ENV = "HF_XET_XORB_COMPRESSION_POLICY"  # hf_xet's own setting wins (xet_sessions)


def _sample(data: Any) -> memoryview | None:
    try:
        view = (data if isinstance(data, Gather) else Gather(data)).sample(SAMPLE_BYTES)
    except (TypeError, ValueError):  # not one contiguous buffer: no guess
        return None
    return view if view.nbytes >= MIN_SAMPLE else None


def compresses(sample: memoryview) -> bool:
    """Whether LZ4, alone or after byte grouping 4 (Xet's two schemes), shrinks ``sample``
    below :data:`INCOMPRESSIBLE` of its size (python-lz4 and numpy release the GIL)."""
    import lz4.block
    import numpy as np

    limit = INCOMPRESSIBLE * sample.nbytes
    if len(lz4.block.compress(sample, store_size=False)) < limit:
        return True
    raw = np.frombuffer(sample, np.uint8)
    grouped = np.ascontiguousarray(raw[: raw.size - raw.size % 4].reshape(-1, 4).T)
    return len(lz4.block.compress(grouped, store_size=False)) < limit


def batch_policy(setting: str, objects: Sequence[Any]) -> str:
    """The policy one upload commit of ``objects`` uses: ``setting``, except that ``auto`` turns
    into ``none`` when every sampled object does not compress (see the module's docstring)."""
    if setting != "auto" or not objects or _POLICY_ENV in os.environ:
        return setting
    n = len(objects)
    picks = sorted({0, n // 2, n - 1})[:SAMPLED_OBJECTS]
    for i in picks:
        sample = _sample(objects[i])
        if sample is None or compresses(sample):
            return "auto"
    return "none"


__all__ = ["INCOMPRESSIBLE", "SAMPLED_OBJECTS", "SAMPLE_BYTES", "batch_policy", "compresses"]
