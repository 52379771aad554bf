"""Checksum records: what fetch checks an entry's files against when it takes them file by file.

Pack members carry a sha256 in their pack's index. Entries fetched file by file (bigger than a
pack, synced with packs off, or grown since their pack) had only their sizes checked, so a flipped
byte in a bucket reached the compiler's cache. Each sync now writes, with the entry's data files
and before its marker, ``.kvbucket/sums/<layout>/<entry>.json``: the size and sha256 of each file.
Fetch reads the records of the entries it downloads in one batched get, hashes each file while its
bytes are still in memory, and installs an entry only when every file matches its record.

The flat area keeps the compiler's own file layout (optimum-neuron reads and writes the same
bucket), so the files themselves are not wrapped in kvbucket's chunk envelope. Entries without a
record (synced before records existed, or by another tool) are fetched by size, as before; the
transfer report lists them as ``unverified``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from kvbucket.compile_cache.layout import REMOTE_META_PREFIX, CacheLayout, LocalEntry
from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import check_name

SUMS_PREFIX = f"{REMOTE_META_PREFIX}sums/"
SUMS_FORMAT = "kvbucket-sums/1"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")

#: file name -> (size, sha256 hex)
Sums = dict[str, tuple[int, str]]


class SumsError(InvalidKeyError):
    """A checksum record kvbucket cannot use (malformed, for another entry, or naming foreign files)."""


def sums_name(layout: CacheLayout, entry: str) -> str:
    """Object name of an entry's checksum record."""
    return f"{SUMS_PREFIX}{layout.name}/{entry}.json"


def is_sums_name(name: str) -> bool:
    return name.startswith(SUMS_PREFIX)


def sha256_of(data: Any) -> str:
    """sha256 hex of a buffer (bytes, memoryview, mmap)."""
    return hashlib.sha256(data).hexdigest()


def make_sums(root: Path, entry: LocalEntry) -> bytes:
    """The record of a local entry, from the bytes on disk now.

    Raises ``OSError`` when a file cannot be read or no longer has the size the scan saw (a
    writer still at work: that entry is not published this time).
    """
    files: dict[str, list[Any]] = {}
    for name in sorted(entry.files):
        with open(root / name, "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
            size = f.tell()
        if size != entry.files[name]:
            raise OSError(f"{name} changed size while syncing ({entry.files[name]} -> {size} bytes)")
        files[name] = [size, digest.hexdigest()]
    return json.dumps({"format": SUMS_FORMAT, "entry": entry.name, "files": files}, sort_keys=True).encode()


def parse_sums(layout: CacheLayout, entry: str, data: bytes) -> Sums:
    """A validated record of ``entry``; :class:`SumsError` says what is wrong."""
    where = f"checksum record {sums_name(layout, entry)}"
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SumsError(f"{where} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != SUMS_FORMAT:
        raise SumsError(f"{where} is not a {SUMS_FORMAT} record")
    if doc.get("entry") != entry:
        raise SumsError(f"{where} describes {doc.get('entry')!r}, not its own entry")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        raise SumsError(f"{where} lists no files")
    out: Sums = {}
    for name, spec in files.items():
        try:
            check_name(name)
        except InvalidKeyError as exc:
            raise SumsError(f"{where} names an unsafe file: {exc}") from None
        if layout.entry_of(name) != entry:
            raise SumsError(f"{where}: file {name!r} is not inside its entry")
        ok = (isinstance(spec, list) and len(spec) == 2 and type(spec[0]) is int and spec[0] >= 0
              and isinstance(spec[1], str) and _SHA_RE.match(spec[1]) is not None)
        if not ok:
            raise SumsError(f"{where}: file {name!r} has a bad size or sha256 {spec!r}")
        out[name] = (spec[0], spec[1])
    return out


def listing_mismatch(sums: Sums, listed: dict[str, int]) -> str | None:
    """None when the store lists exactly the recorded files at the recorded sizes, else what differs.

    A difference is refused before any download: the entry was rewritten since its record (a
    sync in progress) or an object was added, removed or replaced.
    """
    extra = sorted(set(listed) - set(sums))
    missing = sorted(set(sums) - set(listed))
    if extra or missing:
        return f"the store lists {extra or 'no'} extra and {missing or 'no'} missing files"
    sized = [n for n in sorted(sums) if sums[n][0] != listed[n]]
    if sized:
        return f"{sized[0]} has {listed[sized[0]]} bytes, its record says {sums[sized[0]][0]}"
    return None


_PACK_RE = re.compile(r"(?:^|/)\.kvbucket/packs/.+/([0-9a-f]{64})\.pack$")


def pack_digest(name: str) -> str | None:
    """The sha256 a pack object's name promises for its bytes (None when it is not a pack)."""
    m = _PACK_RE.search(name)
    return m.group(1) if m else None


def recorded_files(data: bytes) -> Sums:
    """file -> (size, sha256) of a checksum record, for reading only (``kvbucket verify``).

    Unlike :func:`parse_sums` no layout is known here, so names are not checked against one; a
    record that is not one yields nothing.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == SUMS_FORMAT else None
    if not isinstance(files, dict):
        return {}
    return {n: (v[0], v[1]) for n, v in files.items()
            if isinstance(v, list) and len(v) == 2 and type(v[0]) is int and isinstance(v[1], str)}


__all__ = [
    "SUMS_FORMAT",
    "SUMS_PREFIX",
    "Sums",
    "SumsError",
    "is_sums_name",
    "listing_mismatch",
    "make_sums",
    "pack_digest",
    "parse_sums",
    "recorded_files",
    "sha256_of",
    "sums_name",
]
