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
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvbucket.errors import ConfigError, InvalidKeyError, NoSpaceError, NotFoundError, StoreError
from kvbucket.stores.base import (
    Buffer,
    Gather,
    ItemResult,
    ObjectInfo,
    ObjectStore,
    Scatter,
    VersionedDelete,
    check_buffer_size,
)
from kvbucket.stores.buffers import put_view
from kvbucket.stores.local import versions
from kvbucket.stores.local.paths import (
    DIR_FLAGS,
    DIR_MODE,
    MISSING_ERRNOS,
    O_BINARY,
    O_CLOEXEC,
    O_DIRECTORY,
    O_NOFOLLOW,
    lstat_below,
    open_dir,
    open_object,
    open_regular,
    parents,
    valid_name,
    why_not_a_dir,
)

TMP_DIR_NAME = ".kvbucket-tmp"
DEFAULT_STALE_TMP_SECS = 15 * 60
FILE_MODE = 0o600
_RENAME_ATTEMPTS = 16
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
# Bytes per read when the destination hashes what lands (sealed loads): small enough to stay
# in a core's L2 until hashed, large enough that the per-read overhead stays small. Measured on
# 2 MiB chunks from the page cache: 256 KiB steps 0.82 of an unhashed read, one read 0.70.
HASH_STEP = 256 << 10
_LAST_STEP = HASH_STEP * 3 // 2  # a remainder up to this is read in one step (no tiny last read)


def _store_error(action: str, name: str, e: OSError) -> StoreError:
    """A per-item error naming the object and the OS reason (never the full traceback)."""
    cls = NoSpaceError if e.errno in _NO_SPACE_ERRNOS else StoreError
    return cls(f"could not {action} object {name!r}: {e.strerror or e} (errno {e.errno})")


def _os_error_result(action: str, name: str, e: OSError) -> ItemResult:
    """A batch item's result for an OS error: absent when the name is not a file here, else an error."""
    if e.errno in MISSING_ERRNOS:
        return ItemResult(name)
    return ItemResult(name, error=_store_error(action, name, e))


class FileStore(ObjectStore):
    """Objects as files under ``root``. Thread- and process-safe for concurrent writers."""

    gathers = True  # put_many takes a Gather (written with writev)

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
        self._root_fd = -1
        self._old_root_fds: list[int] = []
        self._root_lock = threading.Lock()
        try:
            self._name_max = os.pathconf(self._root_str, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            self._name_max = 255
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

    # Every path below the root is walked relative to the root's fd without following symlinks
    # (kvbucket.stores.local.paths), so no verb can reach outside the root.
    def _root(self) -> int:
        """The root directory's fd: opened once, reopened when the directory was removed (and
        maybe recreated) behind the store's back. Callers never close it: ``*at`` calls relative
        to one fd are thread-safe; a ``scandir`` needs its own fd (they would share an offset)."""
        fd = self._root_fd
        if fd >= 0:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_nlink > 0:
                    return fd
        with self._root_lock:
            if self._root_fd == fd:  # not reopened by another thread meanwhile
                new = os.open(self._root_str, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                if fd >= 0:
                    self._old_root_fds.append(fd)  # another thread may still use it: closed at exit
                self._root_fd = new
            return self._root_fd

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # ``os.close`` bound at definition and no module globals used: at interpreter exit
        # (e.g. after ``gc.freeze()``) this may run when the module's globals are already None.
        for fd in [getattr(self, "_root_fd", -1), *getattr(self, "_old_root_fds", ())]:
            if fd >= 0:
                try:  # noqa: SIM105 (contextlib may be None at interpreter exit)
                    _close(fd)
                except OSError:
                    pass

    def _open_tmp(self, root_fd: int) -> int:
        try:
            return open_dir(root_fd, TMP_DIR_NAME, [], TMP_DIR_NAME)
        except OSError as e:
            raise (NoSpaceError if e.errno in _NO_SPACE_ERRNOS else StoreError)(
                f"cannot write to store directory {self._root_str!r}: creating {TMP_DIR_NAME} "
                f"failed: {e.strerror}"
            ) from None

    def _fsync_dirs(self, root_fd: int, rel_dir: str) -> None:
        if not rel_dir:
            os.fsync(root_fd)
            return
        with parents(root_fd, rel_dir + "/x") as fds:
            os.fsync(fds[-1])

    # ---- the protocol -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        names = self._check([n for n, _ in items])
        views = [put_view(n, d) for n, d in items]  # a Gather (header + regions): one writev, no copy
        if not names:
            return []
        try:
            root_fd = self._root()
        except OSError as e:
            raise StoreError(f"cannot open store directory {self._root_str!r}: {e.strerror}") from None
        tmp_fd = self._open_tmp(root_fd)
        try:
            return self._put_all(root_fd, tmp_fd, names, views)
        finally:
            os.close(tmp_fd)

    def _put_all(
        self, root_fd: int, tmp_fd: int, names: list[str], views: list[memoryview | Gather]
    ) -> list[ItemResult]:
        results: list[ItemResult] = []
        to_sync: dict[str, list[int]] = {}  # directory -> indexes of the items waiting on its fsync
        for i, (n, v) in enumerate(zip(names, views, strict=True)):
            try:
                dirs, version = self._put_one(root_fd, tmp_fd, n, v)
            except OSError as e:
                results.append(ItemResult(n, error=_store_error("write", n, e)))
                continue
            results.append(ItemResult(n, size=v.nbytes, version=version))
            for d in dirs:
                to_sync.setdefault(d, []).append(i)
        # One fsync per directory per batch (not per object): the renames are durable before
        # put_many returns, which is when they count as stored.
        for d, idxs in to_sync.items():
            try:
                self._fsync_dirs(root_fd, d)
            except OSError as e:
                for i in idxs:
                    results[i] = ItemResult(names[i], error=_store_error("make durable", names[i], e))
        return results

    def _put_one(self, root_fd: int, tmp_fd: int, name: str, view: memoryview | Gather
                 ) -> tuple[list[str], str]:
        """Write one object atomically; return the directories (relative) whose fsync makes it
        durable, and its version."""
        tmp = uuid.uuid4().hex
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY | O_CLOEXEC
        fd = os.open(tmp, flags, FILE_MODE, dir_fd=tmp_fd)
        try:
            try:
                written = 0
                total = view.nbytes
                while written < total:  # os.write may write less than asked (large sizes, signals)
                    if isinstance(view, Gather):
                        written += os.writev(fd, view.views_from(written)[:_IOV_MAX])
                    else:
                        written += os.write(fd, view[written:])
                if self.fsync:
                    os.fsync(fd)
                version = versions.identity(os.fstat(fd))  # a rename keeps it
            finally:
                os.close(fd)
            leaf = name.rsplit("/", 1)[-1]
            created: list[str] = []
            for attempt in range(_RENAME_ATTEMPTS):
                try:
                    if "/" not in name:  # the common case (chunk names): no directory to walk
                        os.replace(tmp, leaf, src_dir_fd=tmp_fd, dst_dir_fd=root_fd)
                    else:
                        with parents(root_fd, name, created) as fds:
                            os.replace(tmp, leaf, src_dir_fd=tmp_fd, dst_dir_fd=fds[-1])
                    break
                except FileNotFoundError:
                    # A directory on the way was removed by a concurrent delete that emptied it
                    # (between our open and the rename): walk again, recreating it.
                    if attempt == _RENAME_ATTEMPTS - 1:
                        raise
                except IsADirectoryError:
                    raise IsADirectoryError(
                        errno.EISDIR, "other objects are stored below this name (it is a directory)"
                    ) from None
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    raise NotADirectoryError(errno.ENOTDIR, why_not_a_dir(root_fd, name)) from None
            if not self.fsync:
                return [], version
            parent = name.rsplit("/", 1)[0] if "/" in name else ""
            return [parent, *(d.rsplit("/", 1)[0] if "/" in d else "" for d in created)], version
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=tmp_fd)
            raise

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        return self.get_each(names, out)

    def get_each(
        self,
        names: Sequence[str],
        out: Sequence[Buffer | None] | None = None,
        after: Callable[[int, ItemResult], ItemResult] | None = None,
    ) -> list[ItemResult]:
        """``get_many``, calling ``after(i, result)`` right after object ``i`` is read and before
        the next read starts; the batch's results are what ``after`` returns.

        Objects are read one after the other, so buffers of ``out`` may share memory: the
        sealing layer reads every encrypted object of a batch into one reused scratch buffer
        and decrypts it into the caller's buffer in ``after`` (docs/integrity.md, "Cost").
        """
        names = self._check(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        results = []
        root_fd = self._root_for("read", names)
        for i, n in enumerate(names):
            buf = out[i] if out is not None else None
            try:
                r = self._get_one(root_fd, n, buf)
            except StoreError as e:
                r = ItemResult(n, error=e)
            except OSError as e:
                r = ItemResult(n, error=_store_error("read", n, e))
            results.append(r if after is None else after(i, r))
        return results

    def _root_for(self, action: str, names: Sequence[str]) -> int:
        """The root's fd for one batch (-1 when the root is gone: every name is then missing)."""
        try:
            return self._root() if names else -1
        except OSError as e:
            if e.errno not in MISSING_ERRNOS:
                raise StoreError(
                    f"could not {action} in store directory {self._root_str!r}: {e.strerror}"
                ) from None
            return -1

    def _get_one(self, root_fd: int, name: str, buf: Buffer | None) -> ItemResult:
        opened = open_regular(root_fd, name)
        if opened is None:
            return ItemResult(name)
        fd, st = opened
        try:
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
                if isinstance(view, Scatter):
                    # A hashed destination (a sealed load) is read in cache-sized steps, each
                    # hashed right after it lands, while it is still in this core's L2: a 2 MiB
                    # load then costs the read plus a hash from cache, not a second pass over
                    # memory (docs/integrity.md, "Cost"). Unhashed ones are read in one readv.
                    if view.hasher is not None and size - got > _LAST_STEP:
                        k = os.readv(fd, view.views_range(got, got + HASH_STEP))
                    else:
                        k = os.readv(fd, view.views_from(got))
                    view.landed(got, got + k)
                else:
                    k = os.readv(fd, [view[got:]])
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

        Cheap on a directory, so the sealing layer checks envelope headers at index rebuild.
        Opened like ``get_many`` (relative to the root, never following a symlink)."""
        names = self._check(names)
        out: list[bytes | None] = []
        root_fd = self._root_for("read", names)
        for name in names:
            try:
                if root_fd < 0:
                    raise FileNotFoundError(errno.ENOENT, "the store directory is gone")
                fd = open_object(root_fd, name)
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
        root_fd = self._root_for("stat", names)
        for n in names:
            try:
                st = lstat_below(root_fd, n)
            except OSError as e:
                results.append(_os_error_result("stat", n, e))
                continue
            regular = stat.S_ISREG(st.st_mode)
            results.append(ItemResult(n, size=st.st_size, version=versions.identity(st)) if regular
                           else ItemResult(n))
        return results

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._check(names)
        results = []
        root_fd = self._root_for("delete", names)
        for n in names:
            try:
                if root_fd < 0:
                    raise FileNotFoundError(errno.ENOENT, "the store directory is gone")
                size = self._delete_one(root_fd, n)
            except OSError as e:
                results.append(_os_error_result("delete", n, e))
                continue
            results.append(ItemResult(n, size=size))
        return results

    def _delete_one(self, root_fd: int, name: str) -> int | None:
        segs = name.split("/")
        with parents(root_fd, name) as fds:
            st = os.stat(segs[-1], dir_fd=fds[-1], follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return None  # nothing we own lives under this name
            os.unlink(segs[-1], dir_fd=fds[-1])
            # Remove the directories above it that it left empty (never the root): without
            # this, a long-lived cache that churns nested names would accumulate empty
            # directories that slow every listing. A concurrent put into a directory being
            # removed walks again and recreates it (see ``_put_one``).
            versions.remove_empty_parents(segs, fds)
        return st.st_size

    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._check(names)
        root_fd = self._root_for("read", names)
        out = []
        for n in names:
            try:
                out.append(versions.read_versioned(root_fd, n))
            except OSError as e:
                out.append(ItemResult(n, error=_store_error("read", n, e)))
        return out

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        """Remove each name only while it is the file its version names (stores/local/versions.py)."""
        self._check([n for n, _ in items])
        if not items or (root_fd := self._root_for("delete", items)) < 0:
            return [VersionedDelete(n) for n, _ in items]
        tmp_fd = self._open_tmp(root_fd)
        try:
            return versions.delete_versions(root_fd, tmp_fd, items)
        finally:
            os.close(tmp_fd)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        # page_size bounds remote round trips; locally one directory is read at a time, so it
        # has nothing to bound. It is validated for protocol compatibility.
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        try:  # a listing's own fd of the root: its scandir must not share an offset
            root_fd = os.open(".", os.O_RDONLY | O_DIRECTORY | O_CLOEXEC, dir_fd=self._root())
        except OSError as e:
            if e.errno in MISSING_ERRNOS:
                return
            raise
        try:
            yield from self._walk(root_fd, "", prefix)
        finally:
            os.close(root_fd)

    def _walk(self, dir_fd: int, rel_dir: str, prefix: str) -> Iterator[ObjectInfo]:
        with os.scandir(dir_fd) as it:
            entries = [(e, e.is_dir(follow_symlinks=False)) for e in it]
        # Sort directories as "name/" so that the walk yields full names in lexicographic order.
        entries.sort(key=lambda ed: ed[0].name + "/" if ed[1] else ed[0].name)
        for entry, is_dir in entries:
            if not rel_dir and entry.name == TMP_DIR_NAME:
                continue
            name = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if is_dir:
                sub = name + "/"
                if sub.startswith(prefix) or prefix.startswith(sub):
                    try:
                        sub_fd = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
                    except OSError as e:
                        if e.errno in MISSING_ERRNOS:
                            continue  # removed, or swapped for a symlink, since the scan
                        raise
                    try:
                        yield from self._walk(sub_fd, name, prefix)
                    finally:
                        os.close(sub_fd)
                continue
            if not name.startswith(prefix):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the scan
            if not stat.S_ISREG(st.st_mode) or not valid_name(name):
                continue
            yield ObjectInfo(name, st.st_size, st.st_mtime, versions.identity(st))

    def close(self) -> None:
        """Nothing to release. Every call opens and closes its own files; the root directory's
        fd is closed when the store is garbage-collected (closing it here could let a call still
        running in another thread act on whatever file reuses the fd number). Idempotent."""

    # ---- maintenance --------------------------------------------------------------------
    def sweep_stale_temp_files(self, older_than_secs: float = DEFAULT_STALE_TMP_SECS) -> int:
        """Remove temp files of crashed writers last modified more than ``older_than_secs`` ago.

        Returns how many were removed. A writer that is alive keeps its temp file's mtime fresh,
        so only a writer stalled for that long could lose its (not yet acknowledged) put.
        """
        cutoff = time.time() - older_than_secs
        removed = 0
        try:
            tmp_fd = os.open(TMP_DIR_NAME, DIR_FLAGS, dir_fd=self._root())  # a symlink is not followed
        except OSError:
            return 0  # no temp dir yet (or not one we made)
        try:
            with os.scandir(tmp_fd) as it:
                for e in it:
                    try:
                        if e.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(e.name, dir_fd=tmp_fd)
                            removed += 1
                    except FileNotFoundError:
                        continue  # renamed into place or swept by another process meanwhile
                    except OSError:
                        continue  # not ours to remove (a directory, read-only mount): opening must not fail
        finally:
            os.close(tmp_fd)
        return removed


__all__ = ["TMP_DIR_NAME", "FileStore"]
