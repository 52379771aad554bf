"""The watch on the connections libcurl keeps alive between direct reads.

Why: on HTTP/1.1 an answer is framed only by its Content-Length. A server (or a middlebox) that
sends more than it announced leaves bytes on a kept-alive connection, and the next request sent
on it reads them as its answer: with a format without an envelope, another key's bytes served as
a hit. libcurl drops a connection whose excess arrived in the same read as the body, but one whose
excess came a moment later stays in its cache, and libcurl checks a cached connection for
pending input only after it has been idle for a second. So kvbucket checks, at the two moments
it can (both in the thread that owns the multi handle, between two ``perform`` calls, so libcurl
is not using a socket meanwhile):

- when a transfer finishes: bytes already waiting on its socket are more than the answer
  announced (over plain HTTP the item is refused: :data:`OVERLONG`; over TLS they may be a TLS
  record such as a session ticket, so only the connection is given up); a connection libcurl
  closed although the server meant to keep it is the excess libcurl itself found;
- when an idle session is taken for the next batch: a kept connection with bytes waiting.

A connection found so is cut at once (:func:`_cut`: its descriptor is pointed at a closed
socket, so libcurl's next use of it fails and libcurl drops it), never reused. What no client
can tell apart is excess that arrives after the next request was sent: it reads as that
request's answer (the envelope of sealed formats catches it, as a miss).
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import socket
import termios
import threading
from collections.abc import Iterable
from typing import Any

import pycurl

from kvbucket.errors import TransientStoreError

#: A direct read whose connection delivered more than the answer's Content-Length: the item is
#: refused (an error, never served), its connection never reused.
OVERLONG = "overlong"


def overlong_error(what: str, endpoint: str) -> TransientStoreError:
    """The error of an item refused as :data:`OVERLONG`; ``what`` names the request."""
    return TransientStoreError(
        f"{what}: {endpoint} sent more bytes than the Content-Length it announced, so the answer "
        "cannot be trusted to be this object's; it was not used and its connection was closed (a "
        "broken server or a proxy between)")


def waiting(fd: int) -> bool:
    """Bytes are waiting to be read on socket ``fd`` (FIONREAD: one system call, never blocks)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:  # not a socket any more, or one in error: libcurl sees to it
        return False
    return count[0] > 0


_closed: socket.socket | None = None  # one end of a socket pair whose other end is closed
_closed_lock = threading.Lock()


def _cut(fd: int) -> None:
    """Cut libcurl's connection on ``fd`` now: ``fd`` is pointed (dup2, atomic) at a socket whose
    peer has gone, so the TCP connection closes (its unread bytes with it) and libcurl's next
    send or read on ``fd`` fails; libcurl then closes ``fd`` itself (a request that had not had
    an answer yet is redone by libcurl on a new connection, or by obstore)."""
    global _closed
    with _closed_lock:
        if _closed is None:
            mine, peer = socket.socketpair()
            peer.close()
            mine.setblocking(False)
            _closed = mine
        os.dup2(_closed.fileno(), fd)


class ConnectionWatch:
    """One libcurl multi handle's kept connections: what each finished transfer left behind.

    It reads sockets (poll, a peeking recv) and cuts a connection only after checking that its
    descriptor still is the socket it recorded (inode), so a number libcurl has closed, even one
    reused by another file, is never touched."""

    __slots__ = ("kept",)

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}  # socket fd -> its inode (the fd may be closed and reused)

    def finished(self, c: pycurl.Curl, url: str, status: int, closing: bool,
                 running: Iterable[tuple[int, Any, pycurl.Curl]] = ()) -> bool:
        """After transfer ``c`` completed (before its handle leaves the multi): True when its
        answer must be refused because its connection delivered more than it announced.

        ``running`` are the batch's other transfers as (index, transfer, handle): libcurl may
        already have sent one of them on this connection, within the same ``perform`` call that
        finished ``c``, so bytes waiting may be that one's answer. Which it is cannot be told:
        the connection is cut (a transfer on it with nothing read yet is redone by libcurl on a
        new connection), one that has read its headers is marked ``suspect`` (its answer is
        fetched again through obstore), and ``c``'s own answer, read before, stands."""
        fd = c.getinfo(pycurl.ACTIVESOCKET)
        if fd < 0:  # not kept: libcurl closed it; unasked (a 200 on a kept-alive answer) = excess
            return status in (200, 206) and not closing  # 206: a ranged GET (direct.py's parts)
        if waiting(fd):
            conn = c.getinfo(pycurl.CONN_ID)
            sharing = [t for _, t, other in running
                       if other is not c and other.getinfo(pycurl.CONN_ID) == conn]
            for t in sharing:  # one with nothing read yet is redone by libcurl on a new connection
                t.suspect = t.headed
            _cut(fd)
            self.kept.pop(fd, None)
            return not sharing and url.startswith("http:")  # over TLS: maybe a TLS record of its own
        if fd not in self.kept or c.getinfo(pycurl.NUM_CONNECTS):  # a new connection on this fd
            try:
                self.kept[fd] = os.fstat(fd).st_ino
            except OSError:
                self.kept.pop(fd, None)
        return False

    def sweep(self) -> int:
        """Before an idle session runs a batch: cut every kept connection with bytes waiting; how
        many were cut."""
        if not self.kept:
            return 0
        poller = select.poll()
        for fd in self.kept:
            poller.register(fd, select.POLLIN | select.POLLPRI)
        cut = 0
        for fd, events in poller.poll(0):
            try:
                same = os.fstat(fd).st_ino == self.kept[fd]
            except OSError:
                same = False
            if not same or events & select.POLLNVAL:  # libcurl closed it: forget the number
                del self.kept[fd]
            elif waiting(fd):
                _cut(fd)
                del self.kept[fd]
                cut += 1
        return cut


__all__ = ["OVERLONG", "ConnectionWatch", "overlong_error", "waiting"]
