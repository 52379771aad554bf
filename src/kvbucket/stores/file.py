"""FileStore: the object-store protocol on a local or mounted directory (the embedded default).

Semantics (see docs/stores.md for the why):

- **Atomic writes.** Every put writes a uniquely named temp file in the hidden directory
  ``<root>/.kvbucket-tmp`` (same filesystem as the objects), optionally fsyncs it, then
  ``os.replace``s it onto the object's path. A reader therefore sees the old object, the new one,
  or nothing; never a mix. Concurrent writers of one name each replace a complete file: the last
  complete write wins.
- **Durability.** ``fsync=True`` also fsyncs the object's directory (and the parents of any
  directory the put created) after the rename, so an acknowledged put survives power loss.
  Without it, a crash can lose recent puts but never leaves a partial object under a name.
- **Names** are paths below the root; nested names create directories (mode 0700). Objects are
  files of mode 0600 (KV caches hold users' prompts). A name whose first segment is the hidden
  temp directory is refused. Deleting an object removes parent directories it leaves empty.
- **Listing** is lazy (one directory in memory at a time) and in lexicographic order of the full
  name, by code point (the same as UTF-8 byte order, the order S3 lists in). Symlinks, special
  files and file names that are not valid object names are not objects and are not listed.
- **Stale temp files** (left by a crashed writer) older than ``stale_tmp_secs`` are removed when
  a store is opened; a live writer keeps its temp file's mtime fresh, so it is never swept.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvbucket.errors import ConfigError, InvalidKeyError, NotFoundError, StoreError
from kvbucket.stores.base import (
    Buffer,
    ItemResult,
    ObjectInfo,
    ObjectStore,
    Scatter,
    check_buffer_size,
    check_name,
)

TMP_DIR_NAME = ".kvbucket-tmp"
DEFAULT_STALE_TMP_SECS = 15 * 60
FILE_MODE = 0o600
DIR_MODE = 0o700
# errnos that mean "this name is not a regular file here": missing, a parent is a file, or the
# final component is a symlink opened with O_NOFOLLOW.
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RENAME_ATTEMPTS = 16


def _store_error(action: str, name: str, e: OSError) -> StoreError:
    """A per-item error naming the object and the OS reason (never the full traceback)."""
    return StoreError(f"could not {action} object {name!r}: {e.strerror or e} (errno {e.errno})")


def _os_error_result(action: str, name: str, e: OSError) -> ItemResult:
    """A batch item's result for an OS error: absent when the name is not a file here, else an error."""
    if e.errno in _MISSING_ERRNOS:
        return ItemResult(name)
    return ItemResult(name, error=_store_error(action, name, e))


class FileStore(ObjectStore):
    """Objects as files under ``root``. Thread- and process-safe for concurrent writers."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        create: bool = True,
        stale_tmp_secs: float = DEFAULT_STALE_TMP_SECS,
    ) -> None:
        root_path = Path(root).expanduser()
        if not str(root):
            raise ConfigError("FileStore needs a directory path")
        root_path = root_path.absolute()
        if root_path.exists() and not root_path.is_dir():
            raise ConfigError(f"FileStore root {str(root_path)!r} exists but is not a directory")
        if not root_path.exists():
            if not create:
                raise NotFoundError(
                    f"store directory {str(root_path)!r} does not exist (check the path; kvbucket only "
                    "creates it when the store is opened for writing)"
                )
            try:
                root_path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"could not create store directory {str(root_path)!r}: {e.strerror}"
                ) from None
        self.root = root_path
        self.fsync = bool(fsync)
        self.url = "file://" + root_path.as_posix()
        self._root_str = os.fspath(root_path)
        self._tmp = os.path.join(self._root_str, TMP_DIR_NAME)
        self._tmp_ready = os.path.isdir(self._tmp)
        try:
            self._name_max = os.pathconf(self._root_str, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            self._name_max = 255
        if self._tmp_ready:
            self.sweep_stale_temp_files(stale_tmp_secs)

    # ---- helpers ------------------------------------------------------------------------
    def _check(self, names: Sequence[str]) -> list[str]:
        if isinstance(names, str):
            raise TypeError("expected a sequence of object names, got a single str")
        checked = self._names(names)
        for n in checked:
            segments = n.split("/")
            if segments[0] == TMP_DIR_NAME:
                raise InvalidKeyError(
                    f"object name {n!r} starts with {TMP_DIR_NAME!r}, the directory FileStore keeps "
                    "its temp files in; choose another first segment"
                )
            for seg in segments:
                if len(seg) * 4 <= self._name_max:
                    continue  # cannot be too long even if every character takes 4 UTF-8 bytes
                if (seg_bytes := len(seg.encode("utf-8", "surrogatepass"))) > self._name_max:
                    raise InvalidKeyError(
                        f"object name {n[:60]!r}... has a segment of {seg_bytes} "
                        f"bytes; this filesystem allows {self._name_max} per file or directory name "
                        "(use a shorter key prefix or model name, or an object store without this limit)"
                    )
        return checked

    def _path(self, name: str) -> str:
        return os.path.join(self._root_str, name)

    def _ensure_tmp_dir(self) -> None:
        if not self._tmp_ready:
            try:
                os.makedirs(self._tmp, mode=DIR_MODE, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"cannot write to store directory {self._root_str!r}: creating {TMP_DIR_NAME} "
                    f"failed: {e.strerror}"
                ) from None
            self._tmp_ready = True

    def _make_parents(self, name: str) -> list[str]:
        """Create the directories ``name`` needs; return the ones this call created."""
        created: list[str] = []
        parts = name.split("/")[:-1]
        d = self._root_str
        for p in parts:
            d = os.path.join(d, p)
            try:
                os.mkdir(d, DIR_MODE)
                created.append(d)
            except FileExistsError:
                try:
                    st = os.lstat(d)
                except FileNotFoundError:
                    continue  # pruned by a concurrent delete just now: the caller's retry recreates it
                if not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "a parent of the name is an object", d) from None
        return created

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- the protocol -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        names = self._check([n for n, _ in items])
        views = []
        for n, d in items:
            try:
                v = memoryview(d)
            except TypeError:
                raise TypeError(f"data for {n!r} is a {type(d).__name__}, not a bytes-like object") from None
            if not v.c_contiguous:
                raise ValueError(f"data for {n!r} is not a contiguous buffer; pass a contiguous copy")
            views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
        self._ensure_tmp_dir()
        results: list[ItemResult] = []
        to_sync: dict[str, list[int]] = {}  # directory -> indexes of the items waiting on its fsync
        for i, (n, v) in enumerate(zip(names, views, strict=True)):
            try:
                dirs = self._put_one(n, v)
            except OSError as e:
                results.append(ItemResult(n, error=_store_error("write", n, e)))
                continue
            results.append(ItemResult(n, size=v.nbytes))
            for d in dirs:
                to_sync.setdefault(d, []).append(i)
        # One fsync per directory per batch (not per object): the renames are durable before
        # put_many returns, which is when they count as stored.
        for d, idxs in to_sync.items():
            try:
                self._fsync_dir(d)
            except OSError as e:
                for i in idxs:
                    results[i] = ItemResult(names[i], error=_store_error("make durable", names[i], e))
        return results

    def _put_one(self, name: str, view: memoryview) -> list[str]:
        """Write one object atomically; return the directories whose fsync makes it durable."""
        tmp = os.path.join(self._tmp, uuid.uuid4().hex)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY | _O_CLOEXEC
        try:
            fd = os.open(tmp, flags, FILE_MODE)
        except FileNotFoundError:  # the temp dir was removed behind our back (e.g. rm -rf): recreate
            os.makedirs(self._tmp, mode=DIR_MODE, exist_ok=True)
            fd = os.open(tmp, flags, FILE_MODE)
        try:
            try:
                written = 0
                total = view.nbytes
                while written < total:  # os.write may write less than asked (large sizes, signals)
                    written += os.write(fd, view[written:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            dest = self._path(name)
            created: list[str] = []
            for attempt in range(_RENAME_ATTEMPTS):
                try:
                    os.replace(tmp, dest)
                    break
                except FileNotFoundError:
                    # The parent is missing: never created, or removed by a concurrent delete
                    # that emptied it. Create it and retry.
                    if attempt == _RENAME_ATTEMPTS - 1 or "/" not in name:
                        raise
                except IsADirectoryError:
                    raise IsADirectoryError(
                        errno.EISDIR, "other objects are stored below this name (it is a directory)"
                    ) from None
                except NotADirectoryError:
                    raise NotADirectoryError(
                        errno.ENOTDIR, "a leading part of this name is an object, so it cannot be a directory"
                    ) from None
                with contextlib.suppress(FileNotFoundError):  # a concurrent delete pruned a level: retry
                    created += self._make_parents(name)
            if not self.fsync:
                return []
            return [os.path.dirname(dest), *(os.path.dirname(d) for d in created)]
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        names = self._check(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        results = []
        for i, n in enumerate(names):
            buf = out[i] if out is not None else None
            try:
                results.append(self._get_one(n, buf))
            except StoreError as e:
                results.append(ItemResult(n, error=e))
            except OSError as e:
                results.append(ItemResult(n, error=_store_error("read", n, e)))
        return results

    def _get_one(self, name: str, buf: Buffer | None) -> ItemResult:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | _O_BINARY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as e:
            if e.errno in _MISSING_ERRNOS:
                return ItemResult(name)
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return ItemResult(name)  # a directory of nested objects is not an object
            size = st.st_size
            if buf is None:
                data = os.read(fd, size) if size else b""
                if len(data) == size:
                    return ItemResult(name, size=size, data=data)
                whole = bytearray(size)  # rare short read: fall through to the readinto loop
                view = memoryview(whole)
            else:
                view = check_buffer_size(name, size, buf)  # before any byte is written
            got = 0
            while got < size:
                k = os.readv(fd, view.views_from(got) if isinstance(view, Scatter) else [view[got:]])
                if k == 0:
                    raise StoreError(
                        f"object {name!r} shrank while being read ({got} of {size} bytes); it was changed "
                        "by something other than kvbucket"
                    )
                got += k
            return ItemResult(name, size=size, data=bytes(view) if buf is None else buf)
        finally:
            os.close(fd)

    def read_prefixes(self, names: Sequence[str], n: int) -> list[bytes | None]:
        """The first ``n`` bytes of each object (fewer when it is shorter), None when unreadable.

        Cheap on a directory, so the sealing layer checks envelope headers at index rebuild."""
        out: list[bytes | None] = []
        for name in self._check(names):
            try:
                fd = os.open(self._path(name), os.O_RDONLY | _O_BINARY | _O_NOFOLLOW | _O_CLOEXEC)
            except OSError:
                out.append(None)
                continue
            try:
                out.append(os.pread(fd, n, 0))
            except OSError:
                out.append(None)
            finally:
                os.close(fd)
        return out

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._check(names)
        results = []
        for n in names:
            try:
                st = os.lstat(self._path(n))
            except OSError as e:
                results.append(_os_error_result("stat", n, e))
                continue
            results.append(ItemResult(n, size=st.st_size if stat.S_ISREG(st.st_mode) else None))
        return results

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._check(names)
        results = []
        for n in names:
            path = self._path(n)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    results.append(ItemResult(n))  # nothing we own lives under this name
                    continue
                os.unlink(path)
            except OSError as e:
                results.append(_os_error_result("delete", n, e))
                continue
            results.append(ItemResult(n, size=st.st_size))
            self._remove_empty_parents(n)
        return results

    def _remove_empty_parents(self, name: str) -> None:
        """Remove the directories above a deleted object that it left empty (never the root).

        Without this, a long-lived cache that churns nested names would accumulate empty
        directories that slow every listing. A concurrent put into a directory being removed
        recreates it (see ``_put_one``).
        """
        parts = name.split("/")[:-1]
        while parts:
            try:
                os.rmdir(os.path.join(self._root_str, *parts))
            except OSError:
                return  # not empty (or already gone): stop climbing
            parts.pop()

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        # page_size bounds remote round trips; locally one directory is read at a time, so it
        # has nothing to bound. It is validated for protocol compatibility.
        return self._walk("", prefix)

    def _walk(self, rel_dir: str, prefix: str) -> Iterator[ObjectInfo]:
        path = os.path.join(self._root_str, rel_dir) if rel_dir else self._root_str
        try:
            with os.scandir(path) as it:
                entries = [(e, e.is_dir(follow_symlinks=False)) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return  # removed while we walked
        # Sort directories as "name/" so that the walk yields full names in lexicographic order.
        entries.sort(key=lambda ed: ed[0].name + "/" if ed[1] else ed[0].name)
        for entry, is_dir in entries:
            if not rel_dir and entry.name == TMP_DIR_NAME:
                continue
            name = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if is_dir:
                sub = name + "/"
                if sub.startswith(prefix) or prefix.startswith(sub):
                    yield from self._walk(name, prefix)
                continue
            if not name.startswith(prefix):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the scan
            if not stat.S_ISREG(st.st_mode) or not _valid_name(name):
                continue
            yield ObjectInfo(name, st.st_size, st.st_mtime)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files. Idempotent."""

    # ---- maintenance --------------------------------------------------------------------
    def sweep_stale_temp_files(self, older_than_secs: float = DEFAULT_STALE_TMP_SECS) -> int:
        """Remove temp files of crashed writers last modified more than ``older_than_secs`` ago.

        Returns how many were removed. A writer that is alive keeps its temp file's mtime fresh,
        so only a writer stalled for that long could lose its (not yet acknowledged) put.
        """
        cutoff = time.time() - older_than_secs
        removed = 0
        try:
            with os.scandir(self._tmp) as it:
                for e in it:
                    try:
                        if e.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(e.path)
                            removed += 1
                    except FileNotFoundError:
                        continue  # renamed into place or swept by another process meanwhile
                    except OSError:
                        continue  # not ours to remove (a directory, read-only mount): opening must not fail
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return removed


def _valid_name(name: str) -> bool:
    try:
        check_name(name)
        name.encode("utf-8")  # undecodable file names come back as surrogates: not ours
    except (InvalidKeyError, UnicodeEncodeError):
        return False
    return True


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"file store option {key}={value!r} must be true or false")


def open_file_store(url: str, **options: Any) -> FileStore:
    """Open ``file:///abs/dir``, ``file://rel/dir`` (relative to the working directory) or a path.

    Everything after ``file://`` is the path, taken verbatim (no percent-decoding, no host part),
    so ``file:///data/kv`` is ``/data/kv`` and ``file://kv`` is ``./kv``; ``~`` is expanded.
    Options: ``fsync`` (bool), ``create`` (bool, default True), ``stale_tmp_secs`` (float).
    """
    if not isinstance(url, str):
        raise ConfigError(f"a file store URL must be a string, got {type(url).__name__}")
    path = url[len("file://") :] if url.startswith("file://") else url
    if not path:
        raise ConfigError(f"{url!r} names no directory; use file:///absolute/dir or file://relative/dir")
    unknown = set(options) - {"fsync", "create", "stale_tmp_secs"}
    if unknown:
        raise ConfigError(
            f"unknown file store option(s) {', '.join(sorted(unknown))}; known: fsync, create, stale_tmp_secs"
        )
    kwargs: dict[str, Any] = {}
    for key in ("fsync", "create"):
        if key in options:
            kwargs[key] = _as_bool(key, options[key])
    if "stale_tmp_secs" in options:
        try:
            kwargs["stale_tmp_secs"] = float(options["stale_tmp_secs"])
        except (TypeError, ValueError):
            value = options["stale_tmp_secs"]
            raise ConfigError(f"stale_tmp_secs={value!r} must be a number of seconds") from None
    return FileStore(path, **kwargs)


__all__ = ["TMP_DIR_NAME", "FileStore", "open_file_store"]
