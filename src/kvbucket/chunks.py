"""KV chunks: the model's KV layout (hence the full-chunk size), zero-copy byte views, serde.

A chunk is the KV cache of ``chunk_tokens`` tokens laid out as LMCache does,
``(num_layers, 2, chunk_tokens, num_kv_heads, head_size)``. Remote tiers only keep *full*
chunks (seeds 001/004), so every tier needs the exact byte size of one: that is
:attr:`KVLayout.full_chunk_bytes`.

Chunks arrive as bytes, bytearray, memoryview, numpy arrays or CPU torch tensors;
:func:`as_view` turns each into a flat ``uint8`` memoryview without copying, so tiers can write
them to files or sockets directly. torch is imported only when a tensor is seen.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbucket.errors import ConfigError, KVBucketError


class ChunkSizeError(KVBucketError, ValueError):
    """A chunk's size is not acceptable to a tier (not a full chunk, or larger than the tier)."""

# Item sizes of the dtype names LMCache and torch use. ``torch.`` prefixes are accepted too.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(dtype: Any) -> int:
    """Bytes per element of a dtype name (``"bfloat16"``), or a torch/numpy dtype object."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name in DTYPE_SIZES:
        return DTYPE_SIZES[name]
    close = difflib.get_close_matches(name, DTYPE_SIZES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"unknown KV dtype {str(dtype)!r}.{hint} Supported: {', '.join(sorted(DTYPE_SIZES))}"
    )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one KV chunk; ``full_chunk_bytes`` is what remote tiers accept.

    ``use_mla`` is for multi-head latent attention models (DeepSeek-V2/V3): one latent vector per
    token and layer instead of a K and a V, as LMCache stores them (pass ``num_kv_heads=1`` and
    the latent size as ``head_size``).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    chunk_tokens: int = 256
    use_mla: bool = False
    itemsize: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "chunk_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        object.__setattr__(self, "itemsize", dtype_size(self.dtype))

    @property
    def kv_factor(self) -> int:
        return 1 if self.use_mla else 2

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """LMCache's chunk shape: ``(layers, 2, chunk_tokens, kv_heads, head_size)`` (1 for MLA)."""
        return (self.num_layers, self.kv_factor, self.chunk_tokens, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def full_chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk_tokens

    def with_chunk_tokens(self, chunk_tokens: int) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_size, self.dtype, chunk_tokens,
                        self.use_mla)

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.kv_factor} x {self.chunk_tokens} tokens x "
            f"{self.num_kv_heads} kv heads x {self.head_size} head size x {self.itemsize} B ({self.dtype})"
        )


def as_view(chunk: Any) -> memoryview:
    """A flat, C-contiguous ``uint8`` memoryview of ``chunk``'s bytes, without copying.

    Accepts bytes-likes, numpy arrays and CPU torch tensors (any dtype, bfloat16 and float8
    included). Non-contiguous arrays and GPU tensors are refused, because a silent copy (or a
    device transfer) inside a cache tier would hide a large cost from the caller.
    """
    if isinstance(chunk, memoryview):
        view = chunk
    elif isinstance(chunk, bytes | bytearray):
        return memoryview(chunk)
    elif type(chunk).__module__.startswith("torch"):
        return _torch_view(chunk)
    else:
        try:
            view = memoryview(chunk)
        except TypeError:
            raise TypeError(
                "a KV chunk must be bytes-like, a numpy array or a CPU torch tensor; "
                f"got {type(chunk).__name__}"
            ) from None
    if not view.c_contiguous:
        raise ValueError(
            "the chunk is not C-contiguous; make it contiguous first (e.g. .copy() / .contiguous())"
        )
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError:
        # formats memoryview cannot cast (e.g. numpy's float16 'e' on some builds): go through numpy
        import numpy as np

        return memoryview(np.asarray(chunk).reshape(-1).view(np.uint8))


def _torch_view(t: Any) -> memoryview:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"unsupported chunk type {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"the chunk is a {t.device.type} tensor; kvbucket tiers take CPU tensors (call .cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(f"the chunk tensor is {t.layout} (not dense); call .to_dense() first")
    if t.is_conj() or t.is_neg():
        # Its memory does not hold the values it shows (torch applies the conjugation or negation
        # lazily): reading into it or storing it as bytes would be silently wrong.
        raise ValueError("the chunk tensor is a lazy conjugate/negative view; call .resolve_conj() "
                         "and .resolve_neg() first")
    if not t.is_contiguous():
        raise ValueError("the chunk tensor is not contiguous; call .contiguous() first")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


# ---- serde ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Serde:
    """How a chunk becomes stored bytes and back. ``size_preserving`` serdes keep the
    full-chunk size check meaningful on the stored object (``naive`` does)."""

    name: str
    serialize: Callable[[memoryview], Any]
    deserialize: Callable[[Any], Any]
    size_preserving: bool = True


def _identity(data: Any) -> Any:
    return data


_SERDES: dict[str, Serde] = {"naive": Serde("naive", _identity, _identity, True)}


def register_serde(serde: Serde) -> None:
    """Add a serde (e.g. a compressing one) under ``serde.name``."""
    _SERDES[serde.name] = serde


def get_serde(name: str) -> Serde:
    serde = _SERDES.get(name)
    if serde is None:
        raise ConfigError(
            f"unknown remote_serde {name!r}; supported: {', '.join(sorted(_SERDES))}"
        )
    return serde


def supported_serdes() -> list[str]:
    return sorted(_SERDES)


__all__ = [
    "DTYPE_SIZES",
    "ChunkSizeError",
    "KVLayout",
    "Serde",
    "as_view",
    "dtype_size",
    "get_serde",
    "register_serde",
    "supported_serdes",
]
