"""Local cache upkeep: what is in a cache dir (status) and removing what poisons it (cleanup)."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbucket.compile_cache.layout import LOCAL_RESERVED_PREFIX, CacheLayout, EntryState
from kvbucket.compile_cache.neuron_env import COMPILER_PROCESS, running_compilers
from kvbucket.errors import ConfigError, KVBucketError


class CompilerRunningError(KVBucketError):
    """Cleanup refused: a compiler is running and may own the locks and entries it would remove."""


@dataclass
class GroupStatus:
    group: str
    current: bool | None  # None: the current compiler version is unknown
    entries: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "current": self.current, "entries": dict(self.entries),
                "bytes": dict(self.bytes)}


def status(layout: CacheLayout, root: Path, current: list[str] | None = None) -> list[GroupStatus]:
    """Entries per group (compiler version) and state, with their bytes."""
    groups: dict[str, GroupStatus] = {}
    for e in layout.scan(Path(root)):
        g = groups.setdefault(e.group, GroupStatus(e.group, None if current is None else e.group in current))
        g.entries[e.state.value] += 1
        g.bytes[e.state.value] += e.nbytes
    return [groups[k] for k in sorted(groups)]


@dataclass
class CleanupReport:
    removed: list[tuple[str, str]] = field(default_factory=list)  # (root-relative path, why)
    bytes: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"removed": [{"path": p, "reason": r} for p, r in self.removed], "bytes": self.bytes,
                "dry_run": self.dry_run}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cleanup(layout: CacheLayout, root: Path, *, old_versions: bool = False, current: list[str] | None = None,
            dry_run: bool = False, check_compilers: bool = True) -> CleanupReport:
    """Remove failed entries, stale locks and dead compiles, kvbucket temp dirs, and old versions.

    Every lock counts as stale because cleanup refuses to run while ``neuronx-cc`` runs (a live
    compiler owns its locks). An entry with a stale lock keeps its files when it is otherwise
    good; without output it is a dead compile and goes.
    """
    root = Path(root)
    if check_compilers and layout.name == "neuron" and (pids := running_compilers()):
        raise CompilerRunningError(
            f"{COMPILER_PROCESS} is running (pid {', '.join(map(str, pids))}); it owns the locks and entries "
            "cleanup would remove. Run cleanup when no compilation is in progress."
        )
    if old_versions and not current:
        raise ConfigError("--old-versions needs to know the current compiler version: "
                          "pass --compiler-version")
    report = CleanupReport(dry_run=dry_run)

    def remove(path: Path, why: str) -> None:
        report.bytes += _size(path)
        report.removed.append((path.relative_to(root).as_posix(), why))
        if dry_run:
            return
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    if not root.is_dir():
        return report
    # kvbucket's own leftovers (a fetch killed between download and rename)
    for p in sorted(root.rglob(f"{LOCAL_RESERVED_PREFIX}-tmp-*")):
        if p.exists():
            remove(p, "unfinished kvbucket download")
    entries = layout.scan(root)
    old: set[str] = set()
    if old_versions and current:
        old = {e.group for e in entries if e.group not in current}
        for g in sorted(old):
            remove(root / g, "old compiler version")
    for e in entries:
        if e.group in old:
            continue
        path = root / e.name
        if e.state is EntryState.FAILED:
            remove(path, "failed compile")
        elif e.state is EntryState.IN_PROGRESS and layout.name in ("neuron", "torch"):
            locks = [root / f for f in e.files if f.endswith(".lock")]
            rest = {os.path.basename(f) for f in e.files if not f.endswith(".lock")}
            if layout.name == "neuron" and layout.state_of(rest) is EntryState.GOOD:  # type: ignore[attr-defined]
                for lk in locks:
                    remove(lk, "stale lock")
            else:
                remove(path, "dead compile (stale lock, no output)")
        elif e.state is EntryState.INCOMPLETE and layout.name in ("neuron", "torch"):
            remove(path, "incomplete entry (no output)")
    return report


__all__ = ["CleanupReport", "CompilerRunningError", "GroupStatus", "cleanup", "status"]
