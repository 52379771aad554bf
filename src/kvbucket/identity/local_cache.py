"""The machine's cache of weight-file digests, so a restart costs one ``stat`` per file.

Hashing the full content of a model's weights is the only way to see a fine-tune of one layer,
and reading 16 GiB costs seconds (minutes from a cold disk): it is done once per machine. Each
file's digest is kept in one small JSON file, keyed by the file's real path and its
``(size, mtime_ns, inode, ctime_ns)``: any rewrite (a new inode, size or mtime; an edit in
place whose mtime was set back still moves the ctime, which no user can set) is a miss and the
file is hashed again; a plain ``touch`` re-hashes it too (to the same digest: the identity holds).
A file changed less than a second before it was hashed is not kept (it is hashed again next
time): a rewrite within one timestamp tick could leave its stat unchanged (git's "racily clean").

Where: ``$KVBUCKET_IDENTITY_CACHE`` (a file path; ``off`` keeps digests in the process only),
else ``$XDG_CACHE_HOME/kvbucket/identity-weights.json`` (``~/.cache/...``). Writes are atomic
(a temporary file renamed over the old one) and serialised between processes by ``flock`` on a
``.lock`` beside it, each writer merging what the file holds first, so concurrent processes
never lose or corrupt each other's entries; readers never lock. A damaged file is ignored (the
digests are recomputed) and rewritten whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("kvbucket.identity")

ENV = "KVBUCKET_IDENTITY_CACHE"
VERSION = 3
#: Entries (files) kept at most: well above a machine's models (a model of 25,000 files is kept
#: whole). Past it, whole model directories go, the least recently written first, never the one
#: being written: a model is never left half cached (its restart would hash the rest again).
MAX_ENTRIES = 100_000

StatKey = tuple[int, int, int, int]  # (size, mtime_ns, inode, ctime_ns)


def cache_path() -> Path | None:
    """The cache file this process uses, or None (``KVBUCKET_IDENTITY_CACHE=off``)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "none", "0") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbucket" / "identity-weights.json"


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): atomic renames still keep the file whole
        yield
        return
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read(path: Path) -> dict[str, list[Any]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.debug("identity cache %s unreadable: %s", path, e)
        return {}
    try:
        doc = json.loads(raw)
        files = doc["files"] if doc.get("version") in (2, VERSION) else {}
        # [size, mtime_ns, inode, ctime_ns, digest, model directory] (version 2 entries: no directory)
        return {k: v if len(v) == 6 else [*v, ""] for k, v in files.items()
                if isinstance(v, list) and len(v) in (5, 6)}
    except Exception as e:  # damaged (a full disk, an editor): recomputed, then rewritten
        log.warning("identity cache %s is damaged (%s); the weight digests in it are recomputed", path, e)
        return {}


class DigestCache:
    """Weight-file digests by (real path, size, mtime_ns, inode, ctime_ns): in the process, and on
    disk."""

    def __init__(self, path: Path | str | None = "default") -> None:
        self.path: Path | None = cache_path() if path == "default" else (Path(path) if path else None)
        self._mem: dict[str, list[Any]] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            if self.path is not None:
                disk = _read(self.path)
                disk.update(self._mem)
                self._mem = disk

    def get(self, real: str, key: StatKey) -> str | None:
        """The digest of file ``real`` when its stat is still ``key``, else None."""
        with self._lock:
            self._load()
            hit = self._mem.get(real)
        if hit is not None and tuple(hit[:4]) == key:
            return str(hit[4])
        return None

    def get_many(self, keys: dict[str, StatKey]) -> dict[str, str]:
        """The digests of the files (real path -> stat key) whose stat is still the one given."""
        with self._lock:
            self._load()
            mem = self._mem
            hits = {real: mem.get(real) for real in keys}
        return {real: str(h[4]) for real, h in hits.items() if h is not None and tuple(h[:4]) == keys[real]}

    def put_many(self, entries: dict[str, tuple[StatKey, str]], group: str = "") -> None:
        """Record digests of the files of model directory ``group``, in the process and (merged
        under the file lock) on disk."""
        if not entries:
            return
        fresh = {real: [*key, digest, group] for real, (key, digest) in entries.items()}
        with self._lock:
            self._load()
            self._mem.update(fresh)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path):
                merged = _read(self.path)
                for real in fresh:
                    merged.pop(real, None)  # re-inserted last: the newest survive pruning
                merged.update(fresh)
                if len(merged) > MAX_ENTRIES:
                    merged = _pruned(merged, group)
                fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({"version": VERSION, "files": merged}, f, separators=(",", ":"))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            with self._lock:
                merged.update(self._mem)
                self._mem = merged
        except OSError as e:  # a read-only home: the digests still hold for this process
            log.warning("cannot write the identity cache %s (%s): weight digests are kept in this "
                        "process only (set %s to a writable file)", self.path, e, ENV)


def _pruned(files: dict[str, list[Any]], keep: str) -> dict[str, list[Any]]:
    """``files`` under :data:`MAX_ENTRIES`: whole model directories dropped, the least recently
    written first (entries are in write order), never ``keep``."""
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, v in enumerate(files.values()):
        last[v[5]] = i
        count[v[5]] = count.get(v[5], 0) + 1
    n, drop = len(files), set()
    for g in sorted(last, key=last.__getitem__):
        if n <= MAX_ENTRIES:
            break
        if g != keep:
            drop.add(g)
            n -= count[g]
    return {k: v for k, v in files.items() if v[5] not in drop}


_default: DigestCache | None = None
_default_lock = threading.Lock()


def default_cache() -> DigestCache:
    """The process's cache at :func:`cache_path` (re-read when the setting changes, e.g. tests)."""
    global _default
    with _default_lock:
        if _default is None or _default.path != cache_path():
            _default = DigestCache()
        return _default


def reset() -> None:
    """Forget what this process holds (as a restart would); the file stays."""
    global _default
    with _default_lock:
        _default = None


__all__ = ["ENV", "DigestCache", "cache_path", "default_cache", "reset", "stat_key"]
