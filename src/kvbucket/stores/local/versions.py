"""Versions of a directory's objects: a file's identity, and removing only the file that was judged.

A version is the file's identity, ``dev:ino:size:mtime_ns`` (from ``fstat`` of the file a read
opened, or ``stat`` in a listing). Writers never change a file in place (a put renames a new file
over the name), so an identity names one content.

:func:`delete_versions` removes a name only while it holds that file, without a window in which
a newer file could be removed instead: it renames the name's current file into the store's temp
directory (the same filesystem; never listed) and compares the identity of what it moved. The
judged file is then unlinked; any other file (a writer replaced the name between the compare and
the rename) is linked back under the name with ``link`` (which never replaces: when yet another
writer has put the name meanwhile, the moved file, superseded, is dropped). What a reader can see
meanwhile is a miss for the instant the name is empty; a write is never lost.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Sequence

from kvbucket.stores.base import ItemResult, VersionedDelete
from kvbucket.stores.local.paths import MISSING_ERRNOS, open_regular, parents


def identity(st: os.stat_result) -> str:
    """The version of a file: device, inode, size and modification time (ns)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def read_versioned(root_fd: int, name: str) -> ItemResult:
    """The whole object and the identity of the file read (a miss: no size)."""
    opened = open_regular(root_fd, name)
    if opened is None:
        return ItemResult(name)
    fd, st = opened
    try:
        data = bytearray(st.st_size)
        view, got = memoryview(data), 0
        while got < st.st_size:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                break  # shrank: changed by something other than kvbucket; judged as read
            got += k
        del view
        return ItemResult(name, size=got, data=bytes(data[:got]), version=identity(st))
    finally:
        os.close(fd)


def remove_empty_parents(segs: list[str], fds: list[int]) -> None:
    """Remove the directories above a removed object that it left empty (never the root)."""
    for i in range(len(segs) - 2, -1, -1):
        try:
            os.rmdir(segs[i], dir_fd=fds[i])
        except OSError:
            break  # not empty (or already gone): stop climbing


def delete_version(root_fd: int, tmp_fd: int, name: str, version: str) -> VersionedDelete:
    """Remove ``name`` only while it is the file ``version`` names (see the module docstring)."""
    segs = name.split("/")
    try:
        with parents(root_fd, name) as fds:
            leaf, dir_fd = segs[-1], fds[-1]
            try:
                st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as e:
                if e.errno in MISSING_ERRNOS:
                    return VersionedDelete(name)
                raise
            if not stat.S_ISREG(st.st_mode):
                return VersionedDelete(name)
            if identity(st) != version:
                return VersionedDelete(name, changed=True)
            tomb = f"del-{uuid.uuid4().hex}"
            try:
                os.rename(leaf, tomb, src_dir_fd=dir_fd, dst_dir_fd=tmp_fd)
            except FileNotFoundError:
                return VersionedDelete(name)  # removed meanwhile
            moved = os.stat(tomb, dir_fd=tmp_fd, follow_symlinks=False)
            if identity(moved) == version:
                os.unlink(tomb, dir_fd=tmp_fd)
                remove_empty_parents(segs, fds)
                return VersionedDelete(name, removed=True)
            # A writer replaced the name between the stat and the rename: give its file back.
            try:
                os.link(tomb, leaf, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                pass  # written yet again meanwhile: the moved file was superseded
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tomb, dir_fd=tmp_fd)
            return VersionedDelete(name, changed=True)
    except OSError as e:
        if e.errno in MISSING_ERRNOS:
            return VersionedDelete(name)
        raise


def delete_versions(root_fd: int, tmp_fd: int, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
    from kvbucket.errors import StoreError

    out = []
    for name, version in items:
        try:
            out.append(delete_version(root_fd, tmp_fd, name, version))
        except OSError as e:
            out.append(VersionedDelete(name, error=StoreError(
                f"could not delete object {name!r}: {e.strerror or e} (errno {e.errno})")))
    return out


__all__ = ["delete_version", "delete_versions", "identity", "read_versioned", "remove_empty_parents"]
