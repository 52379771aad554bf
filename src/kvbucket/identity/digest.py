"""Digests of whole files and of tensors: XXH3-128, in large blocks, on several threads.

XXH3-128 hashes from memory at ~14 GiB/s on one core here and releases the GIL, so threads
hash at once. A file is cut into :data:`SEGMENT` pieces hashed independently (one 5 GiB shard
keeps every thread busy), each from a read-only mapping of the file (no copy out of the page
cache), else read in :data:`BLOCK` reads. A file's digest is the XXH3-128 of its size and its
pieces' digests, in order. Not a cryptographic hash: it tells deployments apart, it does not
defend against someone forging a collision.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

BLOCK = 4 << 20  # a read (preadv) into a buffer that stays in the CPU cache
MAP_BLOCK = 16 << 20  # a hash update over the mapping
SEGMENT = 256 << 20  # hashed on its own by one thread (a multiple of mmap.ALLOCATIONGRANULARITY)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_local = threading.local()


def threads() -> int:
    """Hashing threads: the CPUs this process may use, 2 to 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    return max(2, min(8, n))


def _read_segment(path: str, off: int, length: int) -> bytes:
    """The digest of ``length`` bytes at ``off``, read with ``preadv`` into a per-thread buffer."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(BLOCK)
    mv = memoryview(buf)
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = off + length
        while off < end:
            n = os.preadv(fd, [mv[:min(BLOCK, end - off)]], off)
            if n <= 0:
                raise OSError(f"{path} shrank while it was hashed (at byte {off})")
            h.update(mv[:n])
            off += n
    finally:
        os.close(fd)
    return h.digest()


def _segment(path: str, off: int, length: int) -> bytes:
    """The digest of ``length`` bytes at ``off``: hashed straight from the page cache through a
    read-only mapping (no copy: twice the rate of reading into a buffer here), populated at once
    (``MAP_POPULATE``: one sequential read when cold); read with ``preadv`` where a file cannot
    be mapped. Mapped as safetensors and the engines map the same files to load them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < off + length:  # mapped bytes past the end would fault
            raise OSError(f"{path} shrank while it was hashed (to under {off + length} bytes)")
        m = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=off)
    except (OSError, ValueError):
        return _read_segment(path, off, length)
    finally:
        os.close(fd)
    try:
        with memoryview(m) as mv:
            h = xxhash.xxh3_128()
            for o in range(0, length, MAP_BLOCK):
                h.update(mv[o:o + MAP_BLOCK])
            return h.digest()
    finally:
        m.close()


def hash_files(sizes: dict[str, int], workers: int | None = None) -> dict[str, str]:
    """The content digest (32 hex digits) of each file (path -> its size when stat'ed)."""
    pieces = [(p, off, min(SEGMENT, size - off)) for p, size in sizes.items()
              for off in range(0, max(size, 1), SEGMENT)]
    with ThreadPoolExecutor(workers or threads(), thread_name_prefix="kvbucket-hash") as ex:
        digests = list(ex.map(lambda t: _segment(*t) if t[2] > 0 else b"", pieces))
    out: dict[str, str] = {}
    per: dict[str, list[bytes]] = {}
    for (p, _, _), d in zip(pieces, digests, strict=True):
        per.setdefault(p, []).append(d)
    for p, size in sizes.items():
        out[p] = xxhash.xxh3_128(struct.pack("<Q", size) + b"".join(per[p])).hexdigest()
    return out


def combine(entries: Iterable[tuple[str, int, str]]) -> str:
    """One digest of ``(relative name, size, content digest)`` entries, in the order given."""
    h = xxhash.xxh3_128(b"kvbucket-weights-v2\0")
    for rel, size, digest in entries:
        h.update(f"{rel}\0{size}\0{digest}\n".encode())
    return h.hexdigest()


def hash_buffers(buffers: Iterable[tuple[str, Any]]) -> str:
    """One digest of named byte buffers (a model's parameters): every byte of each, in order."""
    h = xxhash.xxh3_128(b"kvbucket-tensors-v1\0")
    for name, buf in buffers:
        mv = memoryview(buf).cast("B")
        h.update(f"{name}\0{mv.nbytes}\0".encode())
        h.update(mv)
    return h.hexdigest()


__all__ = ["BLOCK", "MAP_BLOCK", "SEGMENT", "combine", "hash_buffers", "hash_files", "threads"]
