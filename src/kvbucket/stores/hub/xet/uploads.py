"""How an object's bytes reach hf_xet's upload commit without holding the GIL per byte.

Why: hf_xet 1.8's ``start_upload_bytes`` takes a ``Vec<u8>``, so PyO3 copies the whole object
while holding the GIL (1.3 s per GiB at 32 MiB objects, measured with ``py-spy --gil``), and
``XetStreamUpload.write`` takes ``&[u8]`` and copies it (``to_vec``) before releasing it.
``start_upload_file`` takes a path and reads the file in Rust, without the GIL. So an object of
at least :data:`STAGE_MIN_BYTES` is written to a file in RAM with ``os.writev`` (which releases
the GIL), straight from the caller's buffers (a :class:`Gather`'s parts: no joined copy either),
and handed over by path.

The invariant, enforced here and nowhere else (tests/hfbucket/test_hfbucket_upload_staging.py):
**a staged object's bytes live only in RAM, only for this process's user, and only while its
upload runs.** That is:

- only on a tmpfs (``/dev/shm``, or the directory ``KVBUCKET_XET_UPLOAD_STAGING`` names; the
  mount's type checked in ``/proc/self/mounts``), never on a persistent disk: without one, with
  too little room left on it, when a write fails, or with the setting ``off``, the object goes
  through ``start_upload_bytes`` as before;
- in a directory of this process made by ``mkdtemp`` (0700), each file created ``O_EXCL |
  O_NOFOLLOW`` with mode 0600 under a fresh name (a name is never reused, so a file unlinked
  early can only make hf_xet's open fail, never read other bytes);
- unlinked when the commit is over (success, failure or abort: :meth:`UploadStaging.close`, called
  by the upload whatever happens, and by the timeout handler before the commit is abandoned),
  the directory removed at process exit (``atexit``), and the directories of dead processes
  (killed mid-upload) removed by the next process that stages.

hf_xet opens a staged file in a background task (after an ingestion permit), so a file is kept
until its commit is over, not only until ``start_upload_file`` returns.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Any

from kvbucket.stores.base import Gather

log = logging.getLogger(__name__)

#: Objects smaller than this are copied by ``start_upload_bytes``: their GIL-held copy is short,
#: and a file costs a create, a write and an unlink here and a stat and an open in hf_xet. At
#: 2 MiB that cost showed in wall time: ``bench_l2.py --backends hfbucket --payloads random``
#: (64 x 2 MiB, LMCache's runner, 2-core machine), four runs alternated, store 0.99-1.04x
#: LMCache's adapter staged against 1.11-1.15x by bytes; from 8 MiB staging cuts the GIL-held
#: time 5-10x (docs/hfbucket.md), so the line is between.
STAGE_MIN_BYTES = 4 << 20
#: Where staged files go by default: a tmpfs only (never a disk).
STAGE_ROOT = "/dev/shm"
#: ``auto`` (default: :data:`STAGE_ROOT`), ``off`` (every object by bytes), or a directory on a tmpfs.
STAGING_ENV = "KVBUCKET_XET_UPLOAD_STAGING"
_PREFIX = "kvbucket-upload-"
_IOV_MAX = 1024  # Linux's limit on the buffers of one writev
_STALE_SECS = 600.0  # a dead process's directory untouched this long is removed

_dir_lock = threading.Lock()
_dirs: dict[tuple[int, str], str] = {}  # (pid, root) -> this process's staging directory
_seq = itertools.count()  # file names: never reused in a process


def _unescape(field: str) -> str:
    """A /proc/self/mounts field (space, tab, newline and backslash are written as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _on_tmpfs(path: str) -> bool:
    """Whether ``path`` is on a tmpfs (RAM): the type of the mount holding it, from /proc/self/mounts."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = [(_unescape(m[1]), m[2]) for m in (line.split() for line in f) if len(m) > 2]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:  # the last mount on the longest matching point is the one in effect
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind == "tmpfs"


_roots: dict[tuple[str, str], str | None] = {}  # (setting, STAGE_ROOT) -> where, checked once


def staging_root() -> str | None:
    """Where uploads stage, from ``KVBUCKET_XET_UPLOAD_STAGING`` (None: off, or not a tmpfs).

    Checked once per setting and process (reading /proc/self/mounts for every object held the
    GIL for a third of a 2 MiB object's staging)."""
    raw = os.environ.get(STAGING_ENV, "auto").strip() or "auto"
    key = (raw, STAGE_ROOT)
    if key in _roots:
        return _roots[key]
    root: str | None = None
    if raw.lower() != "off":
        root = STAGE_ROOT if raw.lower() == "auto" else raw
        if not (_on_tmpfs(root) and os.path.isdir(root)):
            if raw.lower() != "auto":  # auto without a tmpfs: the fallback, quietly
                log.warning("ignoring %s=%r: not a directory on a tmpfs (staged uploads never go to a "
                            "disk); objects are copied into hf_xet's memory instead", STAGING_ENV, raw)
            root = None
    _roots[key] = root
    return root


def _sweep(root: str) -> None:
    """Remove the staging directories of this user's dead processes (killed mid-upload)."""
    uid = os.getuid()
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith(_PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            pid = int(e.name[len(_PREFIX) :].split("-", 1)[0])
        except (OSError, ValueError):
            continue
        if not e.is_dir(follow_symlinks=False) or st.st_uid != uid or now - st.st_mtime < _STALE_SECS:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or its pid reused): left alone
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)


def _remove_dir(pid: int, path: str) -> None:
    if os.getpid() == pid:  # a forked child leaves its parent's directory alone
        shutil.rmtree(path, ignore_errors=True)


def staging_dir() -> str | None:
    """This process's private staging directory on the tmpfs, made on first use (None: no tmpfs)."""
    root = staging_root()
    if root is None:
        return None
    key = (os.getpid(), root)
    with _dir_lock:
        path = _dirs.get(key)
        if path is not None and os.path.isdir(path):
            return path
        _sweep(key[1])
        try:
            path = tempfile.mkdtemp(prefix=f"{_PREFIX}{key[0]}-", dir=key[1])  # mode 0700
        except OSError:
            return None
        for k in [k for k in _dirs if k[0] != key[0]]:
            del _dirs[k]  # a parent's, in a forked child: not ours to use
        _dirs[key] = path
        atexit.register(_remove_dir, key[0], path)
        return path


def _room_for(directory: str, nbytes: int) -> bool:
    """Whether the tmpfs keeps, after ``nbytes`` more, an eighth of it (at least 64 MiB) free."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free - nbytes >= max(64 << 20, total // 8)


def _write_all(fd: int, data: Gather) -> None:
    """Write all of ``data``'s parts with ``os.writev`` (the GIL is released during each call)."""
    done = 0
    while done < data.nbytes:
        n = os.writev(fd, data.views_from(done)[:_IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "a staging write wrote nothing")
        done += n


def upload_bytes(data: Any, reuse: bytearray | None = None) -> bytes | bytearray:
    """What hf_xet's ``start_upload_bytes`` takes fast, with at most one copy here (the fallback).

    It copies a ``bytes`` or ``bytearray`` into its own buffer at memory speed, but reads any
    other buffer item by item (measured, 8 MiB: 8 ms as bytes, 0.2 s as a memoryview, 0.7 s as
    a numpy array). Anything else (a :class:`Gather`, an array) is joined here, object by object
    (each copy overlaps the ingestion of the objects handed over before it), by numpy without the
    GIL, into ``reuse`` when it has the right size: hf_xet has copied the buffer when its call
    returns, so one commit's objects of one size share one buffer (``bytearray(n)`` zeroes fresh
    pages holding the GIL, as long as hf_xet's own copy). Objects that can be staged never come here.
    """
    if type(data) in (bytes, bytearray):
        return data  # type: ignore[no-any-return]
    if isinstance(data, memoryview) and type(data.obj) in (bytes, bytearray) and data.nbytes == len(data.obj):
        return data.obj  # type: ignore[no-any-return]  # a view of a whole bytes object: that object
    try:
        g = data if isinstance(data, Gather) else Gather(data)
    except ValueError:  # not one contiguous buffer
        return bytes(data)
    return g.join(reuse)


class UploadStaging:
    """The staged files of one upload commit: made by :meth:`start`, all unlinked by :meth:`close`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: list[str] = []
        self._closed = False
        self.staged = 0  # objects handed over by file (the others by bytes)
        self._scratch: bytearray | None = None  # the last joined buffer (upload_bytes' reuse)

    def _stage(self, data: Any) -> str | None:
        """A new private file on the tmpfs holding ``data``'s bytes, or None (take the fallback)."""
        nbytes = data.nbytes if isinstance(data, Gather) else memoryview(data).nbytes
        if nbytes < STAGE_MIN_BYTES:
            return None
        directory = staging_dir()
        if directory is None or not _room_for(directory, nbytes):
            return None
        try:
            g = data if isinstance(data, Gather) else Gather(data)
        except (TypeError, ValueError):  # not one contiguous buffer: the fallback copies it
            return None
        path = os.path.join(directory, f"{next(_seq)}.bin")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with self._lock:
            if self._closed:
                raise RuntimeError("the upload is over: nothing more is staged")
            fd = os.open(path, flags, 0o600)
            self._paths.append(path)
        try:
            _write_all(fd, g)
        except OSError as e:  # full tmpfs, memory limit: this object takes the fallback
            log.debug("staging an upload in %s failed (%s): copying it instead", directory, e)
            self._unlink(path)
            return None
        finally:
            os.close(fd)
        return path

    def start(self, commit: Any, data: Any) -> Any:
        """Queue ``data`` on ``commit`` (an hf_xet ``XetUploadCommit``); return its upload handle."""
        from hf_xet import SKIP_SHA256

        path = self._stage(data)
        if path is None:
            buf = upload_bytes(data, reuse=self._scratch)
            handle = commit.start_upload_bytes(buf, sha256=SKIP_SHA256)  # copied when it returns
            callers = buf is data or (isinstance(data, memoryview) and buf is data.obj)
            if type(buf) is bytearray and not callers:  # never a caller's own buffer
                self._scratch = buf  # the next object of this size is joined into it
            return handle
        self.staged += 1
        return commit.start_upload_file(path, sha256=SKIP_SHA256)

    def _unlink(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with self._lock, contextlib.suppress(ValueError):
            self._paths.remove(path)

    def close(self) -> None:
        """Unlink every staged file (idempotent; a later :meth:`start` raises)."""
        with self._lock:
            self._closed = True
            paths, self._paths = self._paths, []
            self._scratch = None
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> UploadStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["STAGE_MIN_BYTES", "STAGE_ROOT", "STAGING_ENV", "UploadStaging", "staging_dir", "staging_root",
           "upload_bytes"]
