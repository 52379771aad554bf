"""The watch on the connections libcurl keeps alive between direct reads.

Why: on HTTP/1.1 an answer is framed only by its Content-Length. A server (or a middlebox) that
sends more than it announced leaves bytes on a kept-alive connection, and the next request sent
on it reads them as its answer: with a format without an envelope, another key's bytes served as
a hit. libcurl drops a connection whose excess arrived in the same read as the body, but one whose
excess came a moment later stays in its cache, and libcurl checks a cached connection for
pending input only after it has been idle for a second. So kvbucket checks, at the two moments
it can (both in the thread that owns the multi handle, so libcurl cannot close a socket under it):

- when a transfer finishes: bytes already waiting on its socket are more than the answer
  announced (over plain HTTP the item is refused: :data:`OVERLONG`; over TLS they may be a TLS
  record such as a session ticket, so only the connection is given up); a connection libcurl
  closed although the server meant to keep it is the excess libcurl itself found;
- when an idle session is taken for the next batch: a kept connection with bytes waiting.

A tainted session takes a fresh connection for every later request of its batch and is closed
(with every connection it keeps) when the batch ends, never reused. What no client can tell apart
is excess that arrives after the next request was sent: it reads as that request's answer (the
envelope of sealed formats catches it, as a miss).
"""

from __future__ import annotations

import os
import select
import socket

import pycurl

#: A direct read whose connection delivered more than the answer's Content-Length: the item is
#: refused (an error, never served), its connection never reused.
OVERLONG = "overlong"


def waiting(fd: int) -> bool:
    """Bytes are waiting to be read on socket ``fd`` (not an end of stream); never blocks."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0)) and _peek(fd)


def _peek(fd: int) -> bool:
    s = socket.socket(fileno=fd)  # borrowed: detached below, never closed here
    try:
        return len(s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0
    except OSError:  # nothing after all (EAGAIN), not a socket, or one in error: libcurl sees to it
        return False
    finally:
        s.detach()


class ConnectionWatch:
    """One libcurl multi handle's kept connections: what each finished transfer left behind.

    Only read (poll, a peeking recv): a socket number libcurl has since closed, even one reused
    by another file, is never harmed; an inode check just forgets it."""

    __slots__ = ("kept", "tainted")

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}  # socket fd -> its inode (the fd may be closed and reused)
        self.tainted = False  # a connection of this multi handle delivered more than announced

    def finished(self, c: pycurl.Curl, url: str, status: int, closing: bool) -> bool:
        """After transfer ``c`` completed (before its handle leaves the multi): True when its
        answer must be refused because its connection delivered more than it announced."""
        fd = c.getinfo(pycurl.ACTIVESOCKET)
        if fd < 0:  # not kept: libcurl closed it; unasked (a 200 on a kept-alive answer) = excess
            if status == 200 and not closing:
                self.tainted = True
                return True
            return False
        if waiting(fd):
            self.tainted = True
            return url.startswith("http:")  # over TLS the bytes may be a TLS record of its own
        if fd not in self.kept or c.getinfo(pycurl.NUM_CONNECTS):  # a new connection on this fd
            try:
                self.kept[fd] = os.fstat(fd).st_ino
            except OSError:
                self.kept.pop(fd, None)
        return False

    def stale(self) -> bool:
        """Before an idle session runs a batch: does a connection it keeps have bytes waiting?"""
        if self.tainted:
            return True
        if not self.kept:
            return False
        poller = select.poll()
        for fd in self.kept:
            poller.register(fd, select.POLLIN | select.POLLPRI)
        for fd, events in poller.poll(0):
            try:
                same = os.fstat(fd).st_ino == self.kept[fd]
            except OSError:
                same = False
            if not same or events & select.POLLNVAL:  # libcurl closed it: forget the number
                del self.kept[fd]
            elif _peek(fd):
                return True
        return False


__all__ = ["OVERLONG", "ConnectionWatch", "waiting"]
