"""What fetch and sync share: batching, the remote listing, the transfer report, model scopes.

Both directions start from ONE listing of the remote area (a request per 1,000 objects) and
diff it against the local scan, so each run moves exactly what is missing. Every store call
takes up to ``batch_files`` (1,000) objects (and ``batch_bytes``); files go to and from the store
as memory maps, so a batch of large NEFFs does not have to fit in the Python heap.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvbucket.batching import batches as _batches
from kvbucket.compile_cache.layout import LOCAL_RESERVED_PREFIX, CacheLayout
from kvbucket.compile_cache.lookup import config_id, model_path, task_segment
from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import ObjectStore, check_name

log = logging.getLogger("kvbucket.compile_cache")

BATCH_FILES = 1000
BATCH_BYTES = 1 << 30
#: Threads writing entries out of a downloaded pack (creating files is the cost that remains).
INSTALL_THREADS = 8
LOCK_NAME = f"{LOCAL_RESERVED_PREFIX}-sync.lock"
TMP_PREFIX = f"{LOCAL_RESERVED_PREFIX}-tmp-"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelScope:
    """A model (and optionally a task and an export config) whose per-model area is used."""

    model_id: str
    task: str | None = None
    config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        model_path(self.model_id)  # validate early, with the user's words
        if self.task is not None:
            task_segment(self.task)
        config_id(self.config)

    def write_path(self) -> str:
        """``org/name/<task>/<config id>``: where this run's references go."""
        return f"{model_path(self.model_id)}/{task_segment(self.task)}/{config_id(self.config)}"

    def read_path(self) -> str:
        """The narrowest prefix the scope pins down (no task: every task of the model)."""
        p = f"{model_path(self.model_id)}/"
        if self.task is not None:
            p += f"{task_segment(self.task)}/"
            if self.config:
                p += f"{config_id(self.config)}/"
        return p


@dataclass
class TransferReport:
    """What one fetch or sync did. Only items that landed are counted."""

    direction: str
    transferred: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    held_back: Counter[str] = field(default_factory=Counter)  # local entries not published, by state
    files: int = 0
    bytes: int = 0
    records: int = 0
    packs: int = 0  # pack objects (with their index) that landed on sync / were used on fetch
    pack_entries: int = 0  # entries written into / taken from those packs
    pack_errors: list[str] = field(default_factory=list)  # packs not written or refused, and why
    unverified: list[str] = field(default_factory=list)  # fetched by size only: no checksum record

    def summary(self) -> str:
        s = (f"{self.direction}: {len(self.transferred)} entries ({self.files} files, {self.bytes} bytes) "
             f"transferred, {len(self.skipped)} already there")
        if self.packs:
            s += f", {self.pack_entries} entries via {self.packs} packs"
        if self.failed:
            s += f", {len(self.failed)} failed"
        if self.pack_errors:
            s += f", {len(self.pack_errors)} pack problems (fell back to per-file)"
        if self.unverified:
            s += f", {len(self.unverified)} without checksum record (sizes checked only)"
        if self.held_back:
            s += ", not published: " + ", ".join(f"{n} {k}" for k, n in sorted(self.held_back.items()))
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"direction": self.direction, "transferred": self.transferred, "skipped": self.skipped,
                "failed": self.failed, "held_back": dict(self.held_back), "files": self.files,
                "bytes": self.bytes, "records": self.records, "packs": self.packs,
                "pack_entries": self.pack_entries, "pack_errors": self.pack_errors,
                "unverified": self.unverified}


def batches(items: Iterable[T], size_of: Callable[[T], int], max_items: int = BATCH_FILES,
            max_bytes: int = BATCH_BYTES) -> Iterator[list[T]]:
    """:func:`kvbucket.batching.batches` with the compile cache's default bounds."""
    return _batches(items, size_of, max_items, max_bytes)


def list_remote(store: ObjectStore, prefixes: Sequence[str]) -> dict[str, int]:
    """Name -> size of every object under the prefixes (prefixes nested in another are skipped).

    Names become local paths on fetch, so a name that could climb out of the cache dir (``..``,
    absolute, backslashes: only a hostile or broken server would list one) is dropped here.
    """
    out: dict[str, int] = {}
    for p in sorted(set(prefixes)):
        if any(q != p and p.startswith(q) for q in prefixes):
            continue
        for o in store.list(p):
            try:
                check_name(o.name)
            except InvalidKeyError:
                log.warning("ignoring remote object with an unsafe name: %r", o.name[:200])
                continue
            out[o.name] = o.size
    return out


def remote_entries(layout: CacheLayout, objects: dict[str, int]) -> dict[str, dict[str, int]]:
    entries: dict[str, dict[str, int]] = {}
    for name, size in objects.items():
        e = layout.entry_of(name)
        if e is not None:
            entries.setdefault(e, {})[name] = size
    return entries


def progress_bar(progress: bool, total: int, desc: str) -> Any:
    """A bar on a terminal, a line every few seconds elsewhere (kvbucket.progress); nothing when
    ``progress`` is false."""
    from kvbucket.progress import Progress

    return Progress(desc, total=total, enabled=progress)


def open_map(path: Path) -> Any:
    """A read-only view of a file's bytes (a memory map; ``b""`` for an empty file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def close_views(views: Iterable[Any]) -> None:
    for v in views:
        if isinstance(v, mmap.mmap):
            with contextlib.suppress(BufferError):
                v.close()



__all__ = [
    "BATCH_BYTES",
    "BATCH_FILES",
    "INSTALL_THREADS",
    "LOCK_NAME",
    "TMP_PREFIX",
    "ModelScope",
    "TransferReport",
    "batches",
    "close_views",
    "list_remote",
    "open_map",
    "progress_bar",
    "remote_entries",
]
