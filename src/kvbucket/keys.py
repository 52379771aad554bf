"""Cache keys and the reversible encoding of keys into object names.

Two key kinds exist, as in LMCache:

- :class:`CacheEngineKey` (non-MP storage backends):
  ``model@world_size@worker_id@{chunk_hash:x}@dtype[@k%v...]``.
- :class:`ObjectKey` (MP-mode L2 adapters): ``<model>@<kv_rank_hex>@<chunk_hash_hex>[@<cache_salt>]``.

Both render to strings that may hold ``/`` (model names such as ``meta-llama/Llama-3.1-8B``)
or ``.``; :func:`encode_name` percent-encodes every byte outside ``[A-Za-z0-9_@~-]`` so the
object name is a single path segment that can never be read as a separator or ``..``, and
:func:`decode_name` gives the key string back, so ``list()`` can answer with key strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import check_name, check_prefix

MAX_SALT_LEN = 128
_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


def _check_model_name(model_name: str) -> str:
    if not isinstance(model_name, str) or not model_name:
        raise InvalidKeyError("model_name must be a non-empty string")
    if "@" in model_name:
        raise InvalidKeyError(
            f"model_name {model_name!r} contains '@', which separates key fields; remove it"
        )
    if "\x00" in model_name:
        raise InvalidKeyError("model_name contains a NUL character")
    return model_name


@dataclass(frozen=True, slots=True)
class CacheEngineKey:
    """LMCache's non-MP chunk key. ``chunk_hash`` is a (possibly negative) int."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    request_configs: dict[str, str] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_model_name(self.model_name)
        for name in ("world_size", "worker_id", "chunk_hash"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise InvalidKeyError(f"{name} must be an int, got {getattr(self, name)!r}")
        if not isinstance(self.dtype, str) or not self.dtype or "@" in self.dtype:
            raise InvalidKeyError(f"dtype must be a non-empty string without '@', got {self.dtype!r}")
        for k, v in (self.request_configs or {}).items():
            if any(c in str(k) for c in "@%") or "@" in str(v):
                raise InvalidKeyError(f"request config {k!r}={v!r} must not contain '@' (or '%' in the name)")

    def to_string(self) -> str:
        s = f"{self.model_name}@{self.world_size}@{self.worker_id}@{self.chunk_hash:x}@{self.dtype}"
        for k, v in (self.request_configs or {}).items():
            s += f"@{k}%{v}"
        return s

    __str__ = to_string

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        parts = s.split("@")
        if len(parts) < 5:
            raise InvalidKeyError(f"not a CacheEngineKey string (need model@ws@worker@hash@dtype): {s!r}")
        model, ws, wid, h, dtype, *extra = parts
        try:
            world_size, worker_id, chunk_hash = int(ws), int(wid), int(h, 16)
        except ValueError as e:
            raise InvalidKeyError(f"bad number in CacheEngineKey string {s!r}: {e}") from None
        configs: dict[str, str] | None = None
        if extra:
            configs = {}
            for item in extra:
                k, sep, v = item.partition("%")
                if not sep or not k:
                    raise InvalidKeyError(f"bad request config {item!r} in {s!r} (expected key%value)")
                configs[k] = v
        return cls(model, world_size, worker_id, chunk_hash, dtype, configs)

    def with_hash(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(
            self.model_name, self.world_size, self.worker_id, chunk_hash, self.dtype, self.request_configs
        )


def pack_kv_rank(world_size: int, rank: int, local_world_size: int = 1, local_rank: int = 0) -> int:
    """LMCache's packed rank: ``ws<<24 | rank<<16 | local_ws<<8 | local_rank`` (each < 256)."""
    for name, v in (("world_size", world_size), ("rank", rank), ("local_world_size", local_world_size),
                    ("local_rank", local_rank)):
        if not 0 <= v < 256:
            raise InvalidKeyError(f"{name}={v} is out of range 0..255")
    return world_size << 24 | rank << 16 | local_world_size << 8 | local_rank


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """The MP-mode key. ``chunk_hash`` is raw bytes; ``cache_salt`` isolates tenants."""

    model_name: str
    kv_rank: int
    chunk_hash: bytes
    cache_salt: str = ""

    def __post_init__(self) -> None:
        _check_model_name(self.model_name)
        if not isinstance(self.kv_rank, int) or isinstance(self.kv_rank, bool) or self.kv_rank < 0:
            raise InvalidKeyError(f"kv_rank must be a non-negative int, got {self.kv_rank!r}")
        if not isinstance(self.chunk_hash, bytes | bytearray) or not self.chunk_hash:
            raise InvalidKeyError("chunk_hash must be non-empty bytes")
        if not isinstance(self.cache_salt, str):
            raise InvalidKeyError("cache_salt must be a string")
        if len(self.cache_salt) > MAX_SALT_LEN:
            raise InvalidKeyError(
                f"cache_salt is {len(self.cache_salt)} characters; the limit is {MAX_SALT_LEN}"
            )
        bad = [c for c in _SALT_FORBIDDEN if c in self.cache_salt]
        if bad:
            raise InvalidKeyError(f"cache_salt must not contain {', '.join(map(repr, bad))}")

    def to_string(self) -> str:
        s = f"{self.model_name}@{self.kv_rank:x}@{bytes(self.chunk_hash).hex()}"
        return f"{s}@{self.cache_salt}" if self.cache_salt else s

    __str__ = to_string

    @classmethod
    def from_string(cls, s: str) -> ObjectKey:
        parts = s.split("@")
        if len(parts) not in (3, 4):
            raise InvalidKeyError(f"not an ObjectKey string (model@rank_hex@hash_hex[@salt]): {s!r}")
        try:
            rank, chunk_hash = int(parts[1], 16), bytes.fromhex(parts[2])
        except ValueError as e:
            raise InvalidKeyError(f"bad hex field in ObjectKey string {s!r}: {e}") from None
        return cls(parts[0], rank, chunk_hash, parts[3] if len(parts) == 4 else "")


# ---- reversible object-name encoding --------------------------------------------------

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-@~")
_ENCODED_RE = re.compile(r"^(?:[A-Za-z0-9_@~-]|%[0-9A-F]{2})+$")
# Each byte's spelling in an encoded key (a table: names are built per key on the lookup path).
_ENCODE_TABLE = tuple(chr(b) if b in _SAFE else f"%{b:02X}" for b in range(256))


def encode_key(key: str | CacheEngineKey | ObjectKey) -> str:
    """Percent-encode a key string into one safe path segment (``.``, ``/``, ``%`` all escaped)."""
    s = key if isinstance(key, str) else key.to_string()
    if not s:
        raise InvalidKeyError("cannot encode an empty key")
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(
            f"key {s!r} is not valid UTF-8 (it holds a lone surrogate); pass keys as proper text"
        ) from None
    return "".join(map(_ENCODE_TABLE.__getitem__, raw))


def decode_key(segment: str) -> str:
    """Invert :func:`encode_key`. Anything it could not have produced is an :class:`InvalidKeyError`."""
    if not _ENCODED_RE.match(segment):
        raise InvalidKeyError(f"{segment!r} is not an encoded kvbucket key")
    out = bytearray()
    i = 0
    while i < len(segment):
        if segment[i] == "%":
            b = int(segment[i + 1 : i + 3], 16)
            if b in _SAFE:
                raise InvalidKeyError(f"{segment!r} escapes a safe character; not produced by encode_key")
            out.append(b)
            i += 3
        else:
            out.append(ord(segment[i]))
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidKeyError(f"{segment!r} does not decode to UTF-8") from None


def key_to_name(key: str | CacheEngineKey | ObjectKey, prefix: str = "") -> str:
    """The object name of a key under an optional prefix (``prefix/encoded``)."""
    prefix = check_prefix(prefix)
    enc = encode_key(key)
    return check_name(f"{prefix}/{enc}" if prefix else enc)


def name_to_key(name: str, prefix: str = "") -> str:
    """The key string of an object name produced by :func:`key_to_name` with the same prefix."""
    prefix = check_prefix(prefix)
    if prefix:
        if not name.startswith(prefix + "/"):
            raise InvalidKeyError(f"object {name!r} is not under prefix {prefix!r}")
        name = name[len(prefix) + 1 :]
    if "/" in name:
        raise InvalidKeyError(f"object {name!r} is nested below the key prefix; not a key object")
    return decode_key(name)


def as_key_string(key: Any) -> str:
    """Accept a key object or its string form."""
    if isinstance(key, str):
        return key
    if isinstance(key, CacheEngineKey | ObjectKey):
        return key.to_string()
    to_string = getattr(key, "to_string", None)  # LMCache's own key classes
    if callable(to_string):
        return str(to_string())
    raise InvalidKeyError(f"not a cache key: {key!r}")


__all__ = [
    "CacheEngineKey",
    "ObjectKey",
    "as_key_string",
    "decode_key",
    "encode_key",
    "key_to_name",
    "name_to_key",
    "pack_kv_rank",
]
