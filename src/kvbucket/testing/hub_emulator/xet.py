"""Xet formats: hashes, xorb chunks and shards, parsed so the emulator can verify every upload.

The emulator must not be poisonable: it recomputes each xorb's hash from the decompressed chunks
and checks shards against the xorbs it holds. Everything here is pure (bytes in, records out),
so it is unit-testable and runs off the event loop in a thread pool.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import blake3
import lz4.frame

DATA_KEY = bytes(
    [102, 151, 245, 119, 91, 149, 80, 222, 49, 53, 203, 172, 165, 151, 24, 28,
     157, 228, 33, 16, 155, 235, 43, 88, 180, 208, 176, 75, 147, 173, 242, 41]
)  # fmt: skip
INTERNAL_NODE_KEY = bytes(
    [1, 126, 197, 199, 165, 71, 41, 150, 253, 148, 102, 102, 180, 138, 2, 230,
     93, 221, 83, 111, 55, 199, 109, 210, 248, 99, 82, 230, 74, 83, 113, 63]
)  # fmt: skip
VERIFICATION_KEY = bytes(
    [127, 24, 87, 214, 206, 86, 237, 102, 18, 127, 249, 19, 231, 165, 195, 243,
     164, 205, 38, 213, 181, 219, 73, 230, 65, 36, 152, 127, 40, 251, 148, 195]
)  # fmt: skip
SHARD_HEADER_TAG = bytes(
    [72, 70, 82, 101, 112, 111, 77, 101, 116, 97, 68, 97, 116, 97, 0, 85,
     105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74, 169]
)  # fmt: skip
ZERO_HASH = bytes(32)
BOOKEND_HASH = b"\xff" * 32
EMPTY_FILE_HASH_HEX = "0" * 64

MAX_CHUNK_BYTES = 128 * 1024 * 2  # generous bound: the client's chunker tops out at 128 KiB
MAX_XORB_BYTES = 64 * 1024 * 1024 + 1024 * 1024  # 64 MiB of chunks plus per-chunk headers
MAX_XORB_CHUNKS = 8 * 1024

_FILE_FLAG_VERIFICATION = 1 << 31
_FILE_FLAG_METADATA_EXT = 1 << 30
_RECORD = 48


class XetFormatError(ValueError):
    """An uploaded xorb or shard is malformed or does not match what it claims."""


def hash_to_hex(h: bytes) -> str:
    """The Xet string form: the 32 bytes as four little-endian u64, each as 16 hex digits."""
    return "".join(h[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def hex_to_hash(s: str) -> bytes:
    """Inverse of ``hash_to_hex``; raises ``XetFormatError`` for anything but 64 hex digits."""
    if len(s) != 64:
        raise XetFormatError(f"a Xet hash is 64 hex digits, got {len(s)} characters")
    try:
        raw = bytes.fromhex(s)
    except ValueError:
        raise XetFormatError("a Xet hash is 64 hex digits (0-9, a-f)") from None
    return b"".join(raw[i : i + 8][::-1] for i in range(0, 32, 8))


def is_hex_hash(s: str) -> bool:
    try:
        hex_to_hash(s)
    except XetFormatError:
        return False
    return True


def chunk_hash(data: bytes) -> bytes:
    return blake3.blake3(data, key=DATA_KEY).digest()


def _next_cut(nodes: list[tuple[bytes, int]], start: int) -> int:
    remaining = len(nodes) - start
    if remaining <= 2:
        return len(nodes)
    end = min(9, remaining)
    for i in range(2, end):
        h = nodes[start + i][0]
        if int.from_bytes(h[24:32], "little") % 4 == 0:
            return start + i + 1
    return start + end


def merkle_root(nodes: list[tuple[bytes, int]]) -> bytes:
    """The aggregated hash of (hash, size) pairs used for xorb and file hashes."""
    if not nodes:
        return ZERO_HASH
    level = list(nodes)
    while len(level) > 1:
        out: list[tuple[bytes, int]] = []
        i = 0
        while i < len(level):
            j = _next_cut(level, i)
            group = level[i:j]
            text = "".join(f"{hash_to_hex(h)} : {n}\n" for h, n in group).encode()
            out.append((blake3.blake3(text, key=INTERNAL_NODE_KEY).digest(), sum(n for _, n in group)))
            i = j
        level = out
    return level[0][0]


def xorb_hash(chunks: list[tuple[bytes, int]]) -> bytes:
    return merkle_root(chunks)


def file_hash(chunks: list[tuple[bytes, int]]) -> bytes:
    if not chunks:
        return ZERO_HASH
    return blake3.blake3(merkle_root(chunks), key=ZERO_HASH).digest()


def range_verification_hash(chunk_hashes: list[bytes]) -> bytes:
    return blake3.blake3(b"".join(chunk_hashes), key=VERIFICATION_KEY).digest()


def decode_chunk(scheme: int, payload: bytes | memoryview, unpacked_len: int) -> bytes:
    """Decompress one chunk payload (scheme 0 none, 1 LZ4 frame, 2 byte-grouping-4 + LZ4)."""
    if scheme == 0:
        data = bytes(payload)
    elif scheme in (1, 2):
        try:
            data = lz4.frame.decompress(payload)
        except RuntimeError as e:
            raise XetFormatError(f"chunk payload is not a valid LZ4 frame: {e}") from None
        if scheme == 2:
            data = _ungroup4(data)
    else:
        raise XetFormatError(f"unknown chunk compression scheme {scheme}")
    if len(data) != unpacked_len:
        raise XetFormatError(f"chunk decompressed to {len(data)} bytes but its header says {unpacked_len}")
    return data


def _ungroup4(grouped: bytes) -> bytes:
    """Undo byte grouping: lanes data[k::4] were concatenated, lane k holding ceil((n-k)/4) bytes."""
    n = len(grouped)
    out = bytearray(n)
    pos = 0
    for k in range(4):
        lane = (n - k + 3) // 4
        out[k::4] = grouped[pos : pos + lane]
        pos += lane
    return bytes(out)


@dataclass(frozen=True)
class XorbIndex:
    """Where each chunk of a stored xorb lies: what reconstruction and range fetches need."""

    hash_hex: str
    byte_offsets: list[int]  # n+1 entries: chunk i occupies [byte_offsets[i], byte_offsets[i+1])
    unpacked_lens: list[int]
    chunk_hashes: list[bytes]

    @property
    def n_chunks(self) -> int:
        return len(self.unpacked_lens)


def iter_chunk_headers(data: bytes | memoryview) -> list[tuple[int, int, int, int]]:
    """(payload offset, compressed length, scheme, unpacked length) of each chunk; checks framing."""
    out: list[tuple[int, int, int, int]] = []
    pos, n = 0, len(data)
    while pos < n:
        if n - pos < 8:
            raise XetFormatError(f"xorb ends with a truncated chunk header at byte {pos}")
        version = data[pos]
        if version != 0:
            raise XetFormatError(f"chunk header at byte {pos} has version {version}, expected 0")
        clen = int.from_bytes(data[pos + 1 : pos + 4], "little")
        scheme = data[pos + 4]
        ulen = int.from_bytes(data[pos + 5 : pos + 8], "little")
        if clen == 0 or ulen == 0 or ulen > MAX_CHUNK_BYTES or clen > MAX_CHUNK_BYTES:
            raise XetFormatError(f"chunk at byte {pos} has bad sizes ({clen} packed, {ulen} unpacked)")
        if pos + 8 + clen > n:
            raise XetFormatError(f"chunk at byte {pos} runs past the end of the xorb")
        out.append((pos + 8, clen, scheme, ulen))
        pos += 8 + clen
        if len(out) > MAX_XORB_CHUNKS:
            raise XetFormatError(f"xorb has more than {MAX_XORB_CHUNKS} chunks")
    return out


def verify_xorb(data: bytes | bytearray, claimed_hex: str) -> XorbIndex:
    """Decode every chunk, recompute the xorb hash and refuse a mismatch."""
    if not data:
        raise XetFormatError("a xorb holds at least one chunk")
    if len(data) > MAX_XORB_BYTES:
        raise XetFormatError(f"xorb is {len(data)} bytes, above the {MAX_XORB_BYTES} limit")
    view = memoryview(data)
    offsets: list[int] = []
    lens: list[int] = []
    hashes: list[bytes] = []
    for off, clen, scheme, ulen in iter_chunk_headers(view):
        if scheme == 0:  # stored raw: hash it in place, no copy
            if clen != ulen:
                raise XetFormatError(f"raw chunk at byte {off - 8} has {clen} bytes, header says {ulen}")
            h = blake3.blake3(view[off : off + clen], key=DATA_KEY).digest()
        else:
            h = chunk_hash(decode_chunk(scheme, view[off : off + clen], ulen))
        offsets.append(off - 8)
        lens.append(ulen)
        hashes.append(h)
    offsets.append(len(data))
    got = hash_to_hex(xorb_hash(list(zip(hashes, lens, strict=True))))
    if got != claimed_hex:
        raise XetFormatError(f"xorb content hashes to {got}, not to the {claimed_hex} named in the URL")
    return XorbIndex(claimed_hex, offsets, lens, hashes)


def verify_xorb_file(path: str, claimed_hex: str) -> XorbIndex:
    """``verify_xorb`` over a file, read through mmap (no copy into Python memory)."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise XetFormatError("a xorb holds at least one chunk")
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        error: str | None = None
        try:
            idx = verify_xorb(mm, claimed_hex)  # type: ignore[arg-type]
        except XetFormatError as e:
            error = str(e)
        # the exception (and the frames holding views of the map) is gone here: now it can close
        mm.close()
        if error is not None:
            raise XetFormatError(error)
        return idx


@dataclass(frozen=True)
class Segment:
    xorb_hex: str
    unpacked_bytes: int
    chunk_start: int
    chunk_end: int  # exclusive


@dataclass
class FileRecord:
    hash_hex: str
    segments: list[Segment] = field(default_factory=list)
    verification: list[bytes] | None = None

    @property
    def size(self) -> int:
        return sum(s.unpacked_bytes for s in self.segments)


@dataclass
class XorbRecord:
    hash_hex: str
    chunk_hashes: list[bytes]
    unpacked_lens: list[int]
    bytes_in_xorb: int


@dataclass
class Shard:
    files: list[FileRecord]
    xorbs: list[XorbRecord]


def parse_shard(data: bytes) -> Shard:
    """Parse the header, file section and xorb section of an uploaded shard (footer not needed)."""
    if len(data) < 48 or data[:32] != SHARD_HEADER_TAG:
        raise XetFormatError("not a Xet shard: the 32-byte header tag does not match")
    version = struct.unpack_from("<Q", data, 32)[0]
    if version != 2:
        raise XetFormatError(f"shard header version {version} is not supported (expected 2)")
    pos = 48

    def record(p: int) -> int:
        if p + _RECORD > len(data):
            raise XetFormatError("shard is truncated inside a record")
        return p

    files: list[FileRecord] = []
    while True:
        record(pos)
        h = data[pos : pos + 32]
        flags, n = struct.unpack_from("<II", data, pos + 32)
        pos += _RECORD
        if h == BOOKEND_HASH:
            break
        rec = FileRecord(hash_to_hex(h))
        for _ in range(n):
            record(pos)
            xh = data[pos : pos + 32]
            _xflags, ub, cs, ce = struct.unpack_from("<IIII", data, pos + 32)
            rec.segments.append(Segment(hash_to_hex(xh), ub, cs, ce))
            pos += _RECORD
        if flags & _FILE_FLAG_VERIFICATION:
            rec.verification = []
            for _ in range(n):
                record(pos)
                rec.verification.append(data[pos : pos + 32])
                pos += _RECORD
        if flags & _FILE_FLAG_METADATA_EXT:
            record(pos)
            pos += _RECORD
        files.append(rec)
    xorbs: list[XorbRecord] = []
    while True:
        record(pos)
        h = data[pos : pos + 32]
        _flags, n, bytes_in_xorb, _on_disk = struct.unpack_from("<IIII", data, pos + 32)
        pos += _RECORD
        if h == BOOKEND_HASH:
            break
        hashes, lens = [], []
        for _ in range(n):
            record(pos)
            hashes.append(data[pos : pos + 32])
            _off, ulen, _cflags, _pad = struct.unpack_from("<IIII", data, pos + 32)
            lens.append(ulen)
            pos += _RECORD
        xorbs.append(XorbRecord(hash_to_hex(h), hashes, lens, bytes_in_xorb))
    return Shard(files, xorbs)
