"""Cache layouts: how a compiler's local cache directory splits into entries, and when one is good.

A *layout* answers four questions for the sync engine, so the engine is written once for every
compiler:

- which local entries exist and in which :class:`EntryState` (only ``GOOD`` ones are ever
  published: failed compiles, held locks and half-written entries would poison every reader);
- which object of an entry is its *completion marker*, uploaded last and required by fetch, so
  an interrupted sync leaves an entry that readers ignore and the next sync completes;
- which remote object names belong to which entry (the flat area mirrors the local layout, so
  a mounted bucket, e.g. with hf-mount, is itself a usable cache directory);
- where the per-model area of a model lives.

Entry and file names are POSIX paths relative to the cache root, and equal the object names of
the flat area (relative to the target's prefix).
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kvbucket.did_you_mean import did_you_mean
from kvbucket.errors import ConfigError

#: Local names kvbucket itself creates (temp dirs of fetches, the sync lock); never entries.
LOCAL_RESERVED_PREFIX = ".kvbucket"
#: Remote prefix of kvbucket's own objects (export records, external markers, model areas).
REMOTE_META_PREFIX = ".kvbucket/"


class EntryState(StrEnum):
    """Where an entry stands. Only GOOD entries are published or count as cached."""

    GOOD = "good"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"  # a lock or temp file: a compile or write is running, or died
    INCOMPLETE = "incomplete"  # neither good nor failed nor locked (e.g. no output yet)


@dataclass(frozen=True, slots=True)
class LocalEntry:
    """One entry of a local cache. ``files`` maps root-relative paths to sizes."""

    name: str
    group: str
    state: EntryState
    files: dict[str, int] = field(default_factory=dict)
    mtime: float = 0.0

    @property
    def leaf(self) -> str:
        return self.name.rsplit("/", 1)[-1]

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


def _walk_files(path: Path, root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Regular files under ``path`` (or ``path`` itself), as (root-relative name, stat)."""
    if path.is_file():
        yield path.relative_to(root).as_posix(), path.stat()
        return
    base = path.relative_to(root).as_posix()
    stack = [(path, base)]
    while stack:
        d, rel = stack.pop()
        try:
            with os.scandir(d) as it:
                items = sorted(it, key=lambda x: x.name)
        except FileNotFoundError:  # removed while we looked: a writer is active
            continue
        for de in items:
            try:
                if de.is_symlink():
                    continue  # never follow links out of the cache dir
                if de.is_dir(follow_symlinks=False):
                    stack.append((Path(de.path), f"{rel}/{de.name}"))
                elif de.is_file(follow_symlinks=False):
                    yield f"{rel}/{de.name}", de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue


def _read_entry(path: Path, root: Path) -> tuple[dict[str, int], float]:
    files: dict[str, int] = {}
    newest = 0.0
    for name, st in _walk_files(path, root):
        files[name] = st.st_size
        newest = max(newest, st.st_mtime)
    return files, newest


class CacheLayout(abc.ABC):
    """The contract between a compiler's cache directory and the sync engine."""

    #: Short name used in URLs, configs and the CLI.
    name: str = ""
    #: Where per-model areas are rooted in the bucket (``""`` = inside the group, as the seed).
    model_area_root: str = ""

    # ---- local side -----------------------------------------------------------------------
    @abc.abstractmethod
    def scan(self, root: Path) -> list[LocalEntry]:
        """Every entry of the local cache with its state (missing root -> no entries)."""

    def current_groups(self) -> list[str] | None:
        """The group(s) this process would use (e.g. the installed compiler's version), if known."""
        return None

    # ---- remote side ----------------------------------------------------------------------
    @abc.abstractmethod
    def entry_of(self, object_name: str) -> str | None:
        """The entry an object of the flat area belongs to, or None when it is not entry data."""

    @abc.abstractmethod
    def group_of(self, entry_name: str) -> str:
        """The group (compiler version) of an entry."""

    @abc.abstractmethod
    def marker(self, entry_name: str) -> str:
        """The object uploaded last for an entry; fetch requires it."""

    def marker_payload(self, entry: LocalEntry) -> bytes | None:
        """Bytes of the marker when it is not one of the entry's own files (else None)."""
        return None

    def remote_complete(self, entry_name: str, names: set[str]) -> bool:
        """Whether the remote objects of an entry (``names``, root-relative) form a good entry."""
        return self.marker(entry_name) in names

    def list_prefixes(self, groups: Iterable[str] | None) -> list[str]:
        """Prefixes whose listing covers the flat area (and model areas) of these groups."""
        if groups is None:
            return [""]
        return sorted({f"{g}/" for g in groups})

    def model_area(self, group: str, model_path: str) -> str:
        """Root-relative prefix of a model's area in one group (``model_path`` = org/name/task...)."""
        return f"{self.model_area_root}{group}/{model_path}"

    def ref_leaf(self, entry_name: str) -> str:
        """The name of an entry's reference in a per-model area (one path segment)."""
        return entry_name.rsplit("/", 1)[-1]

    def entry_from_leaf(self, group: str, leaf: str) -> str:
        """The entry a per-model reference (named by :meth:`ref_leaf`) points to."""
        return f"{group}/{leaf}"

    def entry_state(self, root: Path, entry_name: str) -> EntryState | None:
        """The current local state of one entry (None when absent)."""
        for e in self.scan(root):
            if e.name == entry_name:
                return e.state
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---- neuron ---------------------------------------------------------------------------------

_NEURON_GROUP_RE = re.compile(r"^neuronxcc-[0-9A-Za-z.+_-]+$")
_NEURON_MODULE_RE = re.compile(r"^MODULE_[0-9A-Za-z_.+-]+$")


def neuron_group(compiler_version: str) -> str:
    """``2.15.128.0+56dc5a86`` -> ``neuronxcc-2.15.128.0+56dc5a86`` (already prefixed: unchanged)."""
    v = compiler_version.strip()
    g = v if v.startswith("neuronxcc-") else f"neuronxcc-{v}"
    if not _NEURON_GROUP_RE.match(g):
        raise ConfigError(
            f"compiler version {compiler_version!r} is not a Neuron compiler version such as "
            "2.15.128.0+56dc5a86 (letters, digits, '.', '+', '-', '_')"
        )
    return g


class NeuronLayout(CacheLayout):
    """``neuronxcc-<version>/MODULE_<hlo hash>+<flags hash>/``: good = ``model.neff`` + ``model.done``.

    ``model.log`` without ``model.neff`` is a failed compile (Neuron then refuses to recompile
    that graph, so publishing it would block every reader); any ``*.lock`` is a compile in
    progress or a dead one whose lock makes later runs wait forever.
    """

    name = "neuron"
    NEFF = "model.neff"
    DONE = "model.done"
    LOG = "model.log"

    def __init__(self, compiler_version: str | None = None) -> None:
        self.compiler_version = compiler_version
        self._group = neuron_group(compiler_version) if compiler_version else None

    def current_groups(self) -> list[str] | None:
        if self._group:
            return [self._group]
        from kvbucket.compile_cache.neuron_env import installed_compiler_version

        v = installed_compiler_version()
        return [neuron_group(v)] if v else None

    @staticmethod
    def state_of(filenames: set[str]) -> EntryState:
        if any(f.endswith(".lock") for f in filenames):
            return EntryState.IN_PROGRESS
        if NeuronLayout.NEFF in filenames and NeuronLayout.DONE in filenames:
            return EntryState.GOOD
        if NeuronLayout.LOG in filenames and NeuronLayout.NEFF not in filenames:
            return EntryState.FAILED
        return EntryState.INCOMPLETE

    def scan(self, root: Path) -> list[LocalEntry]:
        out: list[LocalEntry] = []
        if not root.is_dir():
            return out
        for gdir in sorted(root.iterdir()):
            if not (gdir.is_dir() and _NEURON_GROUP_RE.match(gdir.name)):
                continue
            for mdir in sorted(gdir.iterdir()):
                if not (mdir.is_dir() and _NEURON_MODULE_RE.match(mdir.name)):
                    continue
                files, newest = _read_entry(mdir, root)
                base = {n.rsplit("/", 1)[-1] for n in files}
                name = f"{gdir.name}/{mdir.name}"
                out.append(LocalEntry(name, gdir.name, self.state_of(base), files, newest))
        return out

    def entry_of(self, object_name: str) -> str | None:
        parts = object_name.split("/")
        if len(parts) >= 3 and _NEURON_GROUP_RE.match(parts[0]) and _NEURON_MODULE_RE.match(parts[1]):
            return f"{parts[0]}/{parts[1]}"
        return None

    def group_of(self, entry_name: str) -> str:
        return entry_name.split("/", 1)[0]

    def marker(self, entry_name: str) -> str:
        return f"{entry_name}/{self.DONE}"

    def remote_complete(self, entry_name: str, names: set[str]) -> bool:
        return f"{entry_name}/{self.DONE}" in names and f"{entry_name}/{self.NEFF}" in names

    def list_prefixes(self, groups: Iterable[str] | None) -> list[str]:
        return ["neuronxcc-"] if groups is None else super().list_prefixes(groups)


# ---- torch.compile portable artifacts -------------------------------------------------------

_TORCH_GROUP_RE = re.compile(r"^torch-[0-9A-Za-z.+_-]+$")


class TorchLayout(CacheLayout):
    """``torch-<torch version>-<device>/<encoded key>-<sha256[:16]>/{artifacts.bin,artifacts.json}``.

    ``artifacts.bin`` is what ``torch.compiler.save_cache_artifacts()`` returned; it is only valid
    for the same torch (and Triton) version and device, hence the group. ``artifacts.json``
    (describing the blob) is written after the blob locally and uploaded after it remotely: it
    is the marker. Entries are content-addressed, so they never change once written.
    """

    name = "torch"
    BLOB = "artifacts.bin"
    META = "artifacts.json"

    def __init__(self, group: str | None = None) -> None:
        if group is not None and not _TORCH_GROUP_RE.match(group):
            raise ConfigError(f"torch cache group {group!r} must look like torch-2.13.0-cpu")
        self._group = group

    def current_groups(self) -> list[str] | None:
        if self._group:
            return [self._group]
        from kvbucket.compile_cache.torch_env import torch_group

        return [torch_group()]

    def scan(self, root: Path) -> list[LocalEntry]:
        out: list[LocalEntry] = []
        if not root.is_dir():
            return out
        for gdir in sorted(root.iterdir()):
            if not (gdir.is_dir() and _TORCH_GROUP_RE.match(gdir.name)):
                continue
            for edir in sorted(gdir.iterdir()):
                if not edir.is_dir() or edir.name.startswith(LOCAL_RESERVED_PREFIX):
                    continue
                files, newest = _read_entry(edir, root)
                base = {n.rsplit("/", 1)[-1] for n in files}
                if any(b.endswith((".lock", ".tmp")) for b in base):
                    state = EntryState.IN_PROGRESS
                elif {self.BLOB, self.META} <= base:
                    state = EntryState.GOOD
                else:
                    state = EntryState.INCOMPLETE
                out.append(LocalEntry(f"{gdir.name}/{edir.name}", gdir.name, state, files, newest))
        return out

    def entry_of(self, object_name: str) -> str | None:
        parts = object_name.split("/")
        if len(parts) == 3 and _TORCH_GROUP_RE.match(parts[0]) and parts[2] in (self.BLOB, self.META):
            return f"{parts[0]}/{parts[1]}"
        return None

    def group_of(self, entry_name: str) -> str:
        return entry_name.split("/", 1)[0]

    def marker(self, entry_name: str) -> str:
        return f"{entry_name}/{self.META}"

    def remote_complete(self, entry_name: str, names: set[str]) -> bool:
        return f"{entry_name}/{self.META}" in names and f"{entry_name}/{self.BLOB}" in names

    def list_prefixes(self, groups: Iterable[str] | None) -> list[str]:
        return ["torch-"] if groups is None else super().list_prefixes(groups)


# ---- any directory of immutable files ----------------------------------------------------------

#: Names writers use while a file is not finished (Triton: ``tmp.pid_*``; torch's write_atomic:
#: ``.<pid>.<tid>.tmp``; generic ``*.tmp``, ``*.lock``, ``*.partial``, ``*.incomplete``).
_TEMP_RE = re.compile(r"(^tmp\.|\.tmp$|\.tmp\.|\.lock$|\.partial$|\.incomplete$|^\.~)")


def is_temp_name(basename: str) -> bool:
    return bool(_TEMP_RE.search(basename))


class DirectoryLayout(CacheLayout):
    """Any cache dir of immutable files (Triton, Inductor, JAX, vLLM).

    An entry is a child at ``depth`` levels below the root (or a file above that level):
    ``depth=1`` suits Triton (one dir per kernel hash), ``depth=2`` Inductor
    (``fxgraph/<xx>/...``, ``aotautograd/<hash>/...``). An entry is good when none of its files
    has a temp or lock name and, with ``settle_seconds``, nothing in it changed for that long
    (for writers that do not use temp-then-rename). Such directories have no marker of their
    own, so the marker is a manifest kept outside the mirrored tree, at
    ``.kvbucket/complete/<entry>.json``, and uploaded last.
    """

    name = "directory"
    model_area_root = REMOTE_META_PREFIX + "models/"
    MARKERS = REMOTE_META_PREFIX + "complete/"

    def __init__(self, group: str | None = None, settle_seconds: float = 0.0, depth: int = 1) -> None:
        if group is not None and not re.match(r"^[0-9A-Za-z.+_-]+$", group):
            raise ConfigError(f"directory cache version {group!r} must be one path segment of letters, "
                              "digits, '.', '+', '-', '_' (e.g. triton-3.5.0)")
        if not isinstance(depth, int) or not 1 <= depth <= 8:
            raise ConfigError(f"directory layout depth must be 1..8, got {depth!r}")
        self._group = group or "any"
        self.settle_seconds = settle_seconds
        self.depth = depth

    def current_groups(self) -> list[str] | None:
        return None  # the flat area has no version level

    def _children(self, d: Path, rel: str, level: int) -> Iterator[tuple[Path, str]]:
        for child in sorted(d.iterdir()):
            if child.name.startswith(LOCAL_RESERVED_PREFIX) or child.is_symlink():
                continue
            name = f"{rel}/{child.name}" if rel else child.name
            if level < self.depth and child.is_dir() and not is_temp_name(child.name):
                yield from self._children(child, name, level + 1)
            else:
                yield child, name

    def scan(self, root: Path) -> list[LocalEntry]:
        import time

        out: list[LocalEntry] = []
        if not root.is_dir():
            return out
        now = time.time()
        for child, name in self._children(root, "", 1):
            files, newest = _read_entry(child, root)
            if any(is_temp_name(seg) for seg in name.split("/")) or any(
                    is_temp_name(n.rsplit("/", 1)[-1]) for n in files):
                state = EntryState.IN_PROGRESS
            elif not files:
                state = EntryState.INCOMPLETE
            elif self.settle_seconds and now - newest < self.settle_seconds:
                state = EntryState.IN_PROGRESS
            else:
                state = EntryState.GOOD
            out.append(LocalEntry(name, self._group, state, files, newest))
        return out

    def entry_of(self, object_name: str) -> str | None:
        if object_name.startswith(REMOTE_META_PREFIX):
            return None
        parts = object_name.split("/")
        head = parts[: self.depth] if len(parts) > self.depth else parts
        if any(is_temp_name(p) or p.startswith(LOCAL_RESERVED_PREFIX) for p in head):
            return None
        return "/".join(head)

    def ref_leaf(self, entry_name: str) -> str:
        from kvbucket.keys import encode_key

        return encode_key(entry_name)  # one segment even for nested entries

    def group_of(self, entry_name: str) -> str:
        return self._group

    def marker(self, entry_name: str) -> str:
        return f"{self.MARKERS}{entry_name}.json"

    def marker_payload(self, entry: LocalEntry) -> bytes | None:
        return json.dumps({"entry": entry.name, "files": entry.files}, sort_keys=True).encode()

    def list_prefixes(self, groups: Iterable[str] | None) -> list[str]:
        return [""]  # the flat area is the root: give each directory cache its own target prefix

    def entry_from_leaf(self, group: str, leaf: str) -> str:
        from kvbucket.keys import decode_key

        return decode_key(leaf)


LAYOUTS: dict[str, type[CacheLayout]] = {
    "neuron": NeuronLayout,
    "torch": TorchLayout,
    "directory": DirectoryLayout,
}


def get_layout(layout: str | CacheLayout, *, version: str | None = None, depth: int = 1) -> CacheLayout:
    """A layout from its name (``version`` = compiler version / group) or an instance as is."""
    if isinstance(layout, CacheLayout):
        return layout
    if layout == "neuron":
        return NeuronLayout(version)
    if layout == "torch":
        return TorchLayout(version)
    if layout == "directory":
        return DirectoryLayout(version, depth=depth)
    raise ConfigError(f"unknown compile cache layout {layout!r}; {did_you_mean(layout, LAYOUTS)}"
                      f"use one of {', '.join(LAYOUTS)}")


__all__ = [
    "LAYOUTS",
    "CacheLayout",
    "DirectoryLayout",
    "EntryState",
    "LocalEntry",
    "NeuronLayout",
    "TorchLayout",
    "get_layout",
    "is_temp_name",
    "neuron_group",
]
