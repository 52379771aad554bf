"""Benchmark and test payloads: realistic bf16 KV, and random bytes as the second case.

Why: what an engine stores is bf16 K and V, whose high bytes (sign and exponent) repeat enough
that Xet's byte-grouping-4 + LZ4 shrinks them (0.87-0.89 of raw per 64 KiB chunk on the demo
model's own K/V, docs/hfbucket.md), so a reader must decode what a random payload would let
through untouched. Random bytes are the best case for that path; constant payloads are
deduplicated by a Hub bucket and measure nothing. Every benchmark's default payload is
:func:`realistic_kv`, random bytes (:func:`random_bytes`) its second row.

The model of KV here: per (layer, K or V) block of ``tokens`` rows by ``kv_heads * head_size``
channels, each channel has its own scale (log-normal across channels) and, for K, a mean; a
few K channels are outliers (several times the scale, and offset), as measured on Llama-like
models. Values are drawn fresh for every object (a seed per object), so no two objects share a
content-defined chunk: a Hub bucket cannot deduplicate them. ``tests/stores/test_payloads.py``
checks the compression ratio against the demo model's K/V.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

#: The payload kinds a benchmark can be asked for, the default first.
KINDS = ("kv", "random")
#: Xet's compression unit (a content-defined chunk is 64 KiB on average).
XET_CHUNK = 64 * 1024


def _rng(seed: int | bytes | str) -> np.random.Generator:
    raw = seed if isinstance(seed, bytes) else str(seed).encode()
    return np.random.default_rng(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little"))


def realistic_kv(nbytes: int, seed: int | bytes | str, *, kv_heads: int = 8, head_size: int = 128,
                 tokens: int = 256, outlier_fraction: float = 1 / 64) -> np.ndarray:
    """``nbytes`` of bf16 KV values (a flat ``uint8`` array), reproducible from ``seed``.

    Rows of ``kv_heads * head_size`` channels, ``tokens`` rows per (layer, K/V) block, blocks
    alternating K and V (LMCache's layout: layers, then K/V, then tokens, then channels). Each
    block has its own per-channel scales; K blocks have per-channel means and outlier channels.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    channels = kv_heads * head_size
    rng = _rng(seed)
    values = -(-nbytes // 2)  # bf16 values (the last one cut if nbytes is odd)
    blocks = max(1, -(-values // (tokens * channels)))
    z = rng.standard_normal((blocks, tokens, channels), dtype=np.float32)
    # Per (block, channel): log-normal scales; K (even blocks) has means and a few outliers.
    scale = np.exp(rng.normal(-0.5, 0.6, (blocks, 1, channels))).astype(np.float32)
    mean = np.zeros((blocks, 1, channels), np.float32)
    k = np.arange(blocks) % 2 == 0
    mean[k] = rng.normal(0.0, 0.4, (int(k.sum()), 1, channels)).astype(np.float32) * scale[k]
    outliers = rng.random((blocks, 1, channels)) < outlier_fraction
    outliers &= k[:, None, None]
    scale[outliers] *= rng.uniform(6.0, 20.0, int(outliers.sum())).astype(np.float32)
    mean[outliers] += rng.normal(0.0, 4.0, int(outliers.sum())).astype(np.float32)
    z *= scale
    z += mean
    return to_bf16(z).view(np.uint8).reshape(-1)[:nbytes]


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (``uint16``), rounded to nearest even as torch rounds."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def random_bytes(nbytes: int, seed: int | bytes | str) -> np.ndarray:
    """``nbytes`` of uniformly random bytes (a flat ``uint8`` array), reproducible from ``seed``."""
    return _rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def payload(kind: str, nbytes: int, seed: int | bytes | str) -> np.ndarray:
    """The payload of ``kind`` (one of :data:`KINDS`): a flat ``uint8`` array."""
    makers: dict[str, Callable[[int, int | bytes | str], np.ndarray]] = {
        "kv": realistic_kv, "random": random_bytes}
    if kind not in makers:
        raise ValueError(f"unknown payload kind {kind!r}; one of {', '.join(KINDS)}")
    return makers[kind](nbytes, seed)


def byte_group4(chunk: bytes | memoryview | np.ndarray) -> bytes:
    """Xet's byte grouping: bytes ``0, 4, 8 ...`` then ``1, 5, 9 ...`` and so on."""
    a = np.frombuffer(chunk, np.uint8)
    return b"".join(a[i::4].tobytes() for i in range(4))


def xet_ratio(data: bytes | memoryview | np.ndarray, chunk: int = XET_CHUNK, *,
              grouped: bool = True) -> float:
    """Compressed / raw size under Xet's BG4 + LZ4 per ``chunk`` bytes (LZ4 alone with
    ``grouped=False``); a chunk that would grow is stored raw, as Xet does."""
    import lz4.frame

    view = memoryview(np.ascontiguousarray(np.frombuffer(data, np.uint8))).cast("B")
    if not view.nbytes:
        return 1.0
    out = 0
    for pos in range(0, view.nbytes, chunk):
        piece = view[pos : pos + chunk]
        body = byte_group4(piece) if grouped else bytes(piece)
        out += min(len(lz4.frame.compress(body)), piece.nbytes)
    return out / view.nbytes
