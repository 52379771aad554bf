"""Pack objects: many entries in one object, so a fetch is a handful of requests, not one per file.

The flat area costs one request per file on every backend (S3 has no multi-object GET; the Xet
protocol reconstructs file by file). So each sync also writes its new good entries as packs:

- ``<id>.pack``: the entries' files, concatenated, uncompressed (NEFFs and kernels barely compress,
  and the bytes are verified on the way out anyway);
- ``<id>.json``: the index, written only after the pack landed, so it is the pack's completion
  record (a pack without index, e.g. an interrupted upload, is ignored). It lists every entry
  and, per file, its offset, size and sha256.

``<id>`` is the sha256 of the pack's bytes, so two hosts syncing at once never collide (the
same content gives the same name and the same bytes). Packs live at
``.kvbucket/packs/<layout>/<group>/<model area or "flat">/`` next to the flat area, which stays
the authority on which entries exist: fetch takes from packs only entries the flat area lists as
complete, and checks every file against the index before anything reaches the cache dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvbucket.compile_cache.layout import CacheLayout, LocalEntry
from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import check_name

log = logging.getLogger("kvbucket.compile_cache")

PACKS_PREFIX = ".kvbucket/packs/"
PACK_FORMAT = "kvbucket-pack/1"
#: Upper bound of one pack; a sync writes several when its new entries are larger, and an entry
#: larger than this on its own stays per-file only.
PACK_BYTES = 256 << 20
#: A pack this small is always worth downloading when it holds any wanted entry.
SMALL_PACK = 8 << 20
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class PackError(InvalidKeyError):
    """A pack index that kvbucket cannot trust (malformed, or naming paths outside its entries)."""


@dataclass(frozen=True, slots=True)
class PackMember:
    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PackIndex:
    """A parsed, validated index: which entries the pack ``pack`` holds, and where."""

    pack: str
    size: int
    entries: dict[str, list[PackMember]]

    def entry_bytes(self, entry: str) -> int:
        return sum(m.size for m in self.entries[entry])


def pack_dir(layout: CacheLayout, group: str, area: str | None) -> str:
    """Remote folder of the packs of one group, written for one model area (None = the flat area)."""
    return f"{PACKS_PREFIX}{layout.name}/{group}/{area or 'flat'}/"


def group_of_pack(layout: CacheLayout, name: str) -> str | None:
    """The group segment of a pack object's name (None when it is not one of this layout's packs)."""
    head = f"{PACKS_PREFIX}{layout.name}/"
    if not name.startswith(head):
        return None
    return name[len(head):].split("/", 1)[0] or None


@dataclass
class BuiltPack:
    """A pack written to an anonymous local temp file, ready to upload."""

    file: IO[bytes]
    size: int
    sha256: str
    entries: dict[str, list[PackMember]]

    def index(self, pack_name: str, exclude: set[str]) -> tuple[bytes, int]:
        """The index (JSON) and its entry count, leaving out ``exclude`` (entries whose sync failed:
        their bytes stay in the pack, unreferenced)."""
        entries = {e: {m.name: [m.offset, m.size, m.sha256] for m in ms}
                   for e, ms in self.entries.items() if e not in exclude}
        return json.dumps({
            "format": PACK_FORMAT, "pack": pack_name.rsplit("/", 1)[-1], "size": self.size,
            "sha256": self.sha256, "entries": entries,
        }, sort_keys=True).encode(), len(entries)


def build_pack(root: Path, entries: list[LocalEntry]) -> BuiltPack | None:
    """Concatenate the entries' files into a temp file (unnamed, in ``root``: same disk, mode 0600).

    An entry whose files changed size since the scan (or vanished) is left out: a pack only
    holds entries exactly as they were published. None when no entry made it.
    """
    f = tempfile.TemporaryFile(dir=root)  # noqa: SIM115 - handed to the caller in BuiltPack
    whole = hashlib.sha256()
    out: dict[str, list[PackMember]] = {}
    offset = 0
    try:
        for e in entries:
            start, members = offset, []
            whole_before = whole.copy()
            try:
                for name in sorted(e.files):
                    h = hashlib.sha256()
                    n = 0
                    with open(root / name, "rb") as src:
                        while chunk := src.read(_CHUNK):
                            h.update(chunk)
                            whole.update(chunk)
                            f.write(chunk)
                            n += len(chunk)
                    if n != e.files[name]:
                        raise OSError(f"{name} changed size while packing")
                    members.append(PackMember(name, offset, n, h.hexdigest()))
                    offset += n
            except OSError as exc:
                log.warning("not packing %s: %s", e.name, exc)
                f.seek(start)
                f.truncate(start)
                offset, whole = start, whole_before
                continue
            out[e.name] = members
        if not out:
            f.close()
            return None
        f.flush()
        return BuiltPack(f, offset, whole.hexdigest(), out)
    except BaseException:
        f.close()
        raise


def parse_index(layout: CacheLayout, index_name: str, data: bytes, pack_size: int) -> PackIndex:
    """Validate an index against the layout's name rules; raise :class:`PackError` saying what is wrong.

    Every member must be a valid object name inside its entry, the entry must belong to the
    pack's group, and every range must lie inside the pack as listed: a hostile index can
    neither write outside the cache dir nor read outside the pack.
    """
    where = f"pack index {index_name}"
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PackError(f"{where} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != PACK_FORMAT:
        raise PackError(f"{where} is not a {PACK_FORMAT} index")
    pack = index_name[: -len(".json")] + ".pack"
    if doc.get("pack") != pack.rsplit("/", 1)[-1]:
        raise PackError(f"{where} describes {doc.get('pack')!r}, not its own pack")
    if doc.get("size") != pack_size:
        raise PackError(f"{where} says the pack has {doc.get('size')!r} bytes "
                        f"but the store lists {pack_size}")
    group = group_of_pack(layout, index_name)
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise PackError(f"{where} has no entries table")
    out: dict[str, list[PackMember]] = {}
    for entry, files in entries.items():
        try:
            check_name(entry)
        except InvalidKeyError as exc:
            raise PackError(f"{where} names an unsafe entry: {exc}") from None
        if not isinstance(files, dict) or not files:
            raise PackError(f"{where}: entry {entry!r} has no files")
        if layout.group_of(entry) != group:
            raise PackError(f"{where}: entry {entry!r} is not in the pack's group {group!r}")
        members = []
        for name, spec in files.items():
            try:
                check_name(name)
            except InvalidKeyError as exc:
                raise PackError(f"{where} names an unsafe file: {exc}") from None
            if not (name == entry or name.startswith(entry + "/")) or layout.entry_of(name) != entry:
                raise PackError(f"{where}: file {name!r} is not inside its entry {entry!r}")
            ok = (isinstance(spec, list) and len(spec) == 3 and all(type(v) is int for v in spec[:2])
                  and isinstance(spec[2], str) and _SHA_RE.match(spec[2]) is not None)
            if not ok or spec[0] < 0 or spec[1] < 0 or spec[0] + spec[1] > pack_size:
                raise PackError(f"{where}: file {name!r} has a bad range or sha256 {spec!r}")
            members.append(PackMember(name, spec[0], spec[1], spec[2]))
        out[entry] = members
    return PackIndex(pack, pack_size, out)


def entry_complete(layout: CacheLayout, entry: str, members: list[PackMember]) -> bool:
    """Whether a packed entry has what the layout requires (its own marker, when it has one)."""
    names = {m.name for m in members}
    marker = layout.marker(entry)
    if not marker.startswith(entry + "/"):
        names.add(marker)  # the marker lives outside the entry (directory layout): not a file of it
    return layout.remote_complete(entry, names)


def verify(view: Any, members: list[PackMember]) -> str | None:
    """None when every member's bytes match its sha256, else what is wrong (the first mismatch)."""
    for m in members:
        if hashlib.sha256(view[m.offset : m.offset + m.size]).hexdigest() != m.sha256:
            return f"{m.name} does not match its sha256 in the pack index (corrupted or tampered)"
    return None


__all__ = [
    "PACKS_PREFIX",
    "PACK_BYTES",
    "BuiltPack",
    "PackError",
    "PackIndex",
    "PackMember",
    "build_pack",
    "entry_complete",
    "pack_dir",
    "parse_index",
    "verify",
]
