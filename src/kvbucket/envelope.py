"""The chunk envelope: kvbucket's versioned, checksummed, name-bound format for stored objects.

Every persistent tier stores ``header (64 bytes) + payload``. The header says what the payload
is (its length, an xxh3-64 checksum of it, a digest of the object's name, optionally the
model/layout identity and the encryption key id), so a reader can refuse bit rot, torn or
truncated writes, objects copied or renamed under another name, a chunk of another layout, and
a chunk of another tenant, before the caller sees a byte. The header sits in front so a load
reads it into a 64-byte buffer and the payload straight into the caller's buffer with one
scatter read (:class:`~kvbucket.stores.base.Scatter`), without copying the payload.

Layout (little-endian), see docs/integrity.md::

    0   4  magic            b"KVBE"
    4   1  format version   1
    5   1  flags            bit 0: payload is AES-256-GCM ciphertext followed by its 16-byte tag
    6   1  checksum kind    1 = xxh3-64
    7   1  reserved         0
    8   8  payload length   bytes after the header (ciphertext + tag when encrypted)
    16  8  payload checksum xxh3-64 of those bytes
    24  12 name digest      blake2b-96 of the object name (relative to the store's prefix)
    36  8  identity         blake2b-64 of the writer's model/layout identity, zeros when unknown
    44  4  key id           encryption key id, 0 when not encrypted
    48  12 nonce            AES-GCM nonce, zeros when not encrypted
    60  4  header check     low 32 bits of xxh3-64 of bytes 0..59
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any, NamedTuple

import xxhash

from kvbucket.errors import KVBucketError

MAGIC = b"KVBE"
VERSION = 1
HEADER_SIZE = 64
TAG_SIZE = 16
FLAG_AES_GCM = 0x01
CHECKSUM_XXH3_64 = 1
NO_IDENTITY = bytes(8)

_HEADER = struct.Struct("<4sBBBBQQ12s8sI12s")  # bytes 0..59; the header check follows
assert _HEADER.size == HEADER_SIZE - 4

#: Why an object was refused; the ``reason`` label of ``kvbucket_integrity_failures_total``.
REASONS = (
    "unsealed",  # no envelope (written before sealing, or by another program such as LMCache)
    "version",  # an envelope of a format version (or checksum kind) this kvbucket cannot read
    "header",  # the header's own check failed (a flipped header byte)
    "truncated",  # fewer bytes stored than the header (or the caller's buffer) says
    "length",  # more bytes, or a payload of another length than the caller's buffer
    "checksum",  # the payload's bytes changed
    "name",  # the object was written under another name (copied, renamed, swapped)
    "identity",  # written by a writer of another model/layout
    "no_keyring",  # encrypted, and this reader has no keyring
    "key",  # encrypted under a key id this reader's keyring lacks (retired, another tenant's)
    "plaintext",  # a plaintext envelope while this reader's encryption is on
    "decrypt",  # authentication of the ciphertext failed (another tenant's key, tampering)
    "lmcache",  # LMCache's raw format (kvbucket.l2.naming) while this reader's encryption is on
)


class EnvelopeError(KVBucketError):
    """An object failed verification; ``reason`` is one of :data:`REASONS`. Never holds bytes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Header(NamedTuple):
    """A parsed header (a tuple: built on every load, so it is kept cheap)."""

    version: int
    flags: int
    checksum_kind: int
    payload_len: int
    checksum: int
    name_digest: bytes
    identity: bytes
    key_id: int
    nonce: bytes

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_AES_GCM)


@functools.lru_cache(maxsize=65536)
def name_digest(name: str) -> bytes:
    """12 bytes binding an envelope to the object name it was written under."""
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=12,
                           person=b"kvbucket-name").digest()


def identity_digest(identity: str | bytes | None) -> bytes:
    """8 bytes naming what the writer knows of the content (model, KV layout); zeros for none."""
    if identity is None or identity in ("", b""):
        return NO_IDENTITY
    raw = identity.encode() if isinstance(identity, str) else bytes(identity)
    return hashlib.blake2b(raw, digest_size=8, person=b"kvbucket-ident").digest()


def checksum(view: Any) -> int:
    """xxh3-64 of a bytes-like (the fastest of xxh3/crc32c/blake3 here: benchmarks/bench_checksum.py)."""
    return xxhash.xxh3_64_intdigest(view)


def pack_header(
    payload_len: int,
    payload_checksum: int,
    name: str,
    identity: bytes = NO_IDENTITY,
    *,
    key_id: int = 0,
    nonce: bytes = bytes(12),
) -> bytes:
    flags = FLAG_AES_GCM if key_id else 0
    body = _HEADER.pack(MAGIC, VERSION, flags, CHECKSUM_XXH3_64, 0, payload_len, payload_checksum,
                        name_digest(name), identity, key_id, nonce)
    return body + struct.pack("<I", xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF)


def is_sealed(head: Any) -> bool:
    """Whether bytes start with the envelope's magic (any version)."""
    return bytes(memoryview(head)[:4]) == MAGIC


def parse_header(head: Any, name: str) -> Header:
    """Parse and check a 64-byte header read for ``name``; raise :class:`EnvelopeError`.

    Only kvbucket's own chunks can be damaged chunks: bytes count as an envelope only when they
    carry the whole magic and a format version this reader knows, checked before anything else
    (the header check included). Anything else is "unsealed" (``K``, ``KVB``, a text file that
    starts ``KVBE...``) or "version" (a newer format, whose header check may differ), and kept.
    """
    view = memoryview(head)
    n = view.nbytes
    if n < 5 or bytes(view[:4]) != MAGIC:
        raise EnvelopeError("unsealed", f"{name}: no kvbucket envelope")
    version = view[4]
    if version != VERSION:
        raise EnvelopeError("version", f"{name}: envelope format {version} is not one this kvbucket reads")
    if n < HEADER_SIZE:
        raise EnvelopeError("truncated", f"{name}: {n} bytes, shorter than an envelope header")
    _magic, version, flags, kind, reserved, plen, csum, ndig, ident, key_id, nonce = _HEADER.unpack_from(view)
    (check,) = struct.unpack_from("<I", view, HEADER_SIZE - 4)
    if check != xxhash.xxh3_64_intdigest(view[: HEADER_SIZE - 4]) & 0xFFFFFFFF:
        raise EnvelopeError("header", f"{name}: the envelope header is damaged")
    if kind != CHECKSUM_XXH3_64 or reserved or flags & ~FLAG_AES_GCM:
        raise EnvelopeError(
            "version", f"{name}: envelope format {version} (checksum {kind}) is not one this kvbucket reads"
        )
    if ndig != name_digest(name):
        raise EnvelopeError("name", f"{name}: the object was written under another name")
    return Header(version, flags, kind, plen, csum, ndig, ident, key_id, nonce)


def written_digest(head: Any) -> bytes | None:
    """The name digest an intact header holds (whatever name it is read under); None otherwise."""
    view = memoryview(head)
    if view.nbytes < HEADER_SIZE or bytes(view[:4]) != MAGIC:
        return None
    (check,) = struct.unpack_from("<I", view, HEADER_SIZE - 4)
    if check != xxhash.xxh3_64_intdigest(view[: HEADER_SIZE - 4]) & 0xFFFFFFFF:
        return None
    return bytes(_HEADER.unpack_from(view)[7])


def check_identity(header: Header, identity: bytes, name: str) -> None:
    """Refuse a chunk whose writer's identity differs from the reader's (both known)."""
    if identity != NO_IDENTITY and header.identity != NO_IDENTITY and header.identity != identity:
        raise EnvelopeError("identity", f"{name}: written for another model or KV layout")


def check_length(header: Header, payload: Any, name: str) -> None:
    """Check the stored payload's length against the header."""
    n = memoryview(payload).nbytes
    if n != header.payload_len:
        raise EnvelopeError("truncated" if n < header.payload_len else "length",
                            f"{name}: {n} payload bytes stored, the header says {header.payload_len}")


def check_payload(header: Header, payload: Any, name: str) -> None:
    """Check the stored payload's length and checksum against the header."""
    check_length(header, payload, name)
    if checksum(payload) != header.checksum:
        raise EnvelopeError("checksum", f"{name}: the payload's checksum does not match")


def aad(name: str, identity: bytes) -> bytes:
    """Associated data of an encrypted payload: the name and identity are authenticated too."""
    return b"kvbucket-envelope-v1\0" + identity + name.encode("utf-8", "surrogatepass")


__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "NO_IDENTITY",
    "REASONS",
    "TAG_SIZE",
    "VERSION",
    "EnvelopeError",
    "Header",
    "aad",
    "check_identity",
    "check_length",
    "check_payload",
    "checksum",
    "identity_digest",
    "is_sealed",
    "name_digest",
    "pack_header",
    "parse_header",
    "written_digest",
]
