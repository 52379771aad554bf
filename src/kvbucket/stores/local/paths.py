"""Paths below a store's root directory, walked so that a symlink inside the store is never followed.

Every path is resolved one component at a time, relative to the directory opened just before
it, with ``O_NOFOLLOW``: a symlink (or a directory swapped for one mid-call) anywhere inside the
store is never followed, so no verb of :class:`~kvbucket.stores.local.file.FileStore` can reach
outside its root. The root itself is the configured path and may be reached through symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import check_name

DIR_MODE = 0o700
# errnos that mean "this name is not a regular file here": missing, a parent is a file, or the
# final component is a symlink opened with O_NOFOLLOW.
MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
O_BINARY = getattr(os, "O_BINARY", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
READ_FLAGS = os.O_RDONLY | O_BINARY | O_NOFOLLOW | O_CLOEXEC


@contextlib.contextmanager
def parents(root_fd: int, name: str, created: list[str] | None = None) -> Iterator[list[int]]:
    """The fds of the root and of every directory above ``name``'s last component.

    ``fds[i]`` is the directory holding segment ``i`` of the name. Missing directories raise
    ``FileNotFoundError``, unless ``created`` is given: then they are made (0700) and their
    relative paths appended to it. A component that is a file or a symlink raises
    ``NotADirectoryError``/``ELOOP``.
    """
    fds = [root_fd]
    try:
        segs = name.split("/")[:-1]
        for i, seg in enumerate(segs):
            fds.append(open_dir(fds[-1], seg, created, "/".join(segs[: i + 1])))
        yield fds
    finally:
        for fd in fds[1:]:
            os.close(fd)


def open_dir(parent_fd: int, seg: str, created: list[str] | None, rel: str) -> int:
    """Open directory ``seg`` of ``parent_fd`` without following a symlink; with ``created``,
    make it first when missing (and record ``rel`` there)."""
    try:
        return os.open(seg, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if created is None:
            raise
    try:
        os.mkdir(seg, DIR_MODE, dir_fd=parent_fd)
        created.append(rel)
    except FileExistsError:
        pass  # made by a concurrent writer just now
    return os.open(seg, DIR_FLAGS, dir_fd=parent_fd)


def open_object(root_fd: int, name: str) -> int:
    """Open object ``name`` for reading (never through a symlink); raises ``OSError``."""
    if "/" not in name:  # the common case (chunk names): no directory to walk
        return os.open(name, READ_FLAGS, dir_fd=root_fd)
    with parents(root_fd, name) as fds:
        return os.open(name.rsplit("/", 1)[-1], READ_FLAGS, dir_fd=fds[-1])


def open_regular(root_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    """Open object ``name`` and ``fstat`` it: ``(fd, stat)`` for the caller to close, or None when
    it is missing, the root is gone (``root_fd < 0``) or the name is a directory of nested objects
    (not an object). Other ``OSError`` s are raised."""
    try:
        if root_fd < 0:
            return None
        fd = open_object(root_fd, name)
    except OSError as e:
        if e.errno in MISSING_ERRNOS:
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def lstat_below(root_fd: int, name: str) -> os.stat_result:
    """``lstat`` of object ``name`` (a symlink is reported as one, never followed)."""
    if root_fd < 0:
        raise FileNotFoundError(errno.ENOENT, "the store directory is gone")
    if "/" not in name:
        return os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    with parents(root_fd, name) as fds:
        return os.stat(name.rsplit("/", 1)[-1], dir_fd=fds[-1], follow_symlinks=False)


def why_not_a_dir(root_fd: int, name: str) -> str:
    """Which leading part of ``name`` stopped a put: an object, or a symlink (never followed)."""
    segs = name.split("/")[:-1]
    fd = os.dup(root_fd)
    try:
        for seg in segs:
            st = os.stat(seg, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                return (f"{seg!r}, a leading part of this name, is a symlink; kvbucket never follows "
                        "links inside a store (remove it)")
            if not stat.S_ISDIR(st.st_mode):
                break
            nfd = os.open(seg, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError:
        pass
    finally:
        os.close(fd)
    return "a leading part of this name is an object, so it cannot be a directory"


def valid_name(name: str) -> bool:
    """Whether a file name found in a listing is an object name this store could have written."""
    try:
        check_name(name)
        name.encode("utf-8")  # undecodable file names come back as surrogates: not ours
    except (InvalidKeyError, UnicodeEncodeError):
        return False
    return True


__all__ = [
    "DIR_FLAGS",
    "DIR_MODE",
    "MISSING_ERRNOS",
    "READ_FLAGS",
    "lstat_below",
    "open_dir",
    "open_object",
    "open_regular",
    "parents",
    "valid_name",
    "why_not_a_dir",
]
