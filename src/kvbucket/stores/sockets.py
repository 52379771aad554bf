"""What a socket holds unread, asked of the kernel without reading it.

Shared by the S3 watch on kept connections (stores/s3/kept.py: bytes after an answer) and the Hub
reader's parse turns (stores/hub/xet/turns.py: whether a body's next read would wait)."""

from __future__ import annotations

import array
import fcntl
import termios


def waiting_count(fd: int) -> int:
    """Bytes waiting to be read on socket ``fd`` (FIONREAD: one system call, never blocks); 0
    for a socket in error or no longer one (its reader sees to it)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:
        return 0
    return count[0]


def bytes_waiting(fd: int) -> bool:
    """Bytes are waiting to be read on socket ``fd``."""
    return waiting_count(fd) > 0


__all__ = ["bytes_waiting", "waiting_count"]
