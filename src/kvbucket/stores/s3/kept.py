"""The watch on the connections libcurl keeps alive between direct reads.

Why: on HTTP/1.1 an answer is framed only by its Content-Length. A server (or a middlebox) that
sends more than it announced leaves bytes on a kept-alive connection, and the next request sent
on it reads them as its answer: with a format without an envelope, another key's bytes served as
a hit. libcurl drops a connection whose excess arrived in the same read as the body, but one whose
excess came a moment later stays in its cache, and libcurl checks a cached connection for
pending input only after it has been idle for a second. So kvbucket checks, at the moments it
can (all in the thread that owns the multi handle, where libcurl is not reading the socket):

- **just before a request is sent on a kept connection** (libcurl's pre-request callback,
  :meth:`ConnectionWatch.prereq`): nothing of this request is on the wire yet, so any byte
  waiting is the previous answer's excess, whatever the timing. That transfer is refused (over
  plain HTTP: :data:`OVERLONG`; over TLS the bytes may be a TLS record such as a session ticket,
  so only the connection is given up) and the connection cut; libcurl sends the request again on
  a new connection. A clean check records that the previous transfer left its connection intact;
- **when a transfer finishes** (:meth:`ConnectionWatch.finished`), if no later request was sent
  on its connection: bytes already waiting are more than the answer announced; a connection
  libcurl closed although the server meant to keep it, and no later request took it, is the
  excess libcurl itself found. (libcurl may hand a finished transfer's connection to a transfer
  added before, within the same ``perform`` call, before kvbucket sees the first one finish:
  the pre-request check has then judged that connection, and a close or bytes seen after it
  are the later request's, not the finished one's: reading them as excess refused honest
  answers and sent requests twice.)
- **when an idle session is taken for the next batch** (:meth:`ConnectionWatch.sweep`): a kept
  connection with bytes waiting.

**Invariant (a connection is judged once per answer, before it carries another request).** The
pre-request check is the one place that sees a reused connection between two requests; it
knows the connection by its local port, recorded when libcurl opened the socket for a transfer
(:meth:`ConnectionWatch.prereq` with that transfer's ``fd``), and only while that socket is the
one on the port. A connection the watch did not see open gets the finish-time checks alone.
tests/s3/test_s3_overlong.py checks both sides: an honest answer beside an over-long one is
served, and the over-long one is refused, across many batches.

A connection found so is cut at once (:func:`_cut`: its descriptor is pointed at a closed
socket, so libcurl's next use of it fails and libcurl drops it), never reused. What no client
can tell apart is excess that arrives after the next request was sent: it reads as that
request's answer (the envelope of sealed formats catches it, as a miss). Over TLS the checks
see only what the TLS library has not read: libcurl reads a body no further than its
Content-Length, so excess sharing a TLS record with the body's last bytes waits decrypted in
the library's buffer, not on the socket (docs/s3.md says what that means for unsealed formats).
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Iterable
from typing import Any

import pycurl

from kvbucket.errors import TransientStoreError
from kvbucket.stores.sockets import bytes_waiting as waiting

#: A direct read whose connection delivered more than the answer's Content-Length: the item is
#: refused (an error, never served), its connection never reused.
OVERLONG = "overlong"


def overlong_error(what: str, endpoint: str) -> TransientStoreError:
    """The error of an item refused as :data:`OVERLONG`; ``what`` names the request."""
    return TransientStoreError(
        f"{what}: {endpoint} sent more bytes than the Content-Length it announced, so the answer "
        "cannot be trusted to be this object's; it was not used and its connection was closed (a "
        "broken server or a proxy between)")


_closed: socket.socket | None = None  # one end of a socket pair whose other end is closed
_closed_lock = threading.Lock()


def _local_port(fd: int) -> int:
    """The local port of socket ``fd`` (-1 if it is not an IP socket any more)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            name = s.getsockname()
    except OSError:
        return -1
    return name[1] if isinstance(name, tuple) else -1


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
    reused by another file, is never touched. Transfers (``direct._Transfer``) carry what the
    watch learns of them: ``fd`` (the socket libcurl opened for it, until its first request),
    ``handed`` (its connection was found clean and taken by a later request) and ``excess``
    (bytes were waiting on its connection before the next request)."""

    __slots__ = ("_ports", "kept")

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}  # socket fd -> its inode (the fd may be closed and reused)
        #: local port -> [fd, the last transfer that sent a request on that connection]
        self._ports: dict[int, list[Any]] = {}

    def prereq(self, t: Any, local_port: int) -> int:
        """libcurl's pre-request callback for transfer ``t`` (a connection is set up or reused
        and nothing of the request is sent yet): judge what the connection's previous answer
        left on it (see the module doc)."""
        fd, t.fd, t.port = t.fd, -1, local_port
        if fd >= 0:  # a socket libcurl opened for t: a new connection, this is its first request
            if _local_port(fd) == local_port:
                self._ports[local_port] = [fd, t]
            else:  # another attempt's socket won (happy eyeballs): the finish-time checks only
                self._ports.pop(local_port, None)
            return pycurl.PREREQFUNC_OK
        seen = self._ports.get(local_port)
        if seen is None:
            return pycurl.PREREQFUNC_OK
        fd, before = seen  # before: None once its finish has been judged (see finished)
        if waiting(fd):  # before t sends a byte: the previous answer's excess
            if before is not None:
                before.excess = not before.url.startswith("https:")  # over TLS: maybe a TLS record
            _cut(fd)  # t's request fails on it and libcurl sends it again on a new connection
            self.kept.pop(fd, None)
            del self._ports[local_port]
        else:
            if before is not None:
                before.handed = True
            seen[1] = t
        return pycurl.PREREQFUNC_OK

    def finished(self, c: pycurl.Curl, t: Any,
                 running: Iterable[tuple[int, Any, pycurl.Curl]] = ()) -> bool:
        """After transfer ``t`` (on handle ``c``) completed, before its handle leaves the multi:
        True when its answer must be refused because its connection delivered more than it
        announced.

        ``running`` are the batch's other transfers as (index, transfer, handle). One of them
        may already have been sent on this connection within the ``perform`` call that finished
        ``t``: the pre-request check judged the connection then (``t.handed`` or ``t.excess``),
        and what is seen on it now belongs to that request. Where the watch did not see the
        connection open, which it is cannot be told: the connection is cut (a transfer on it
        with nothing read yet is redone by libcurl on a new connection), one that has read its
        headers is marked ``suspect`` (its answer is fetched again through obstore), and
        ``t``'s own answer, read before, stands."""
        if t.excess:
            return True
        if t.handed:  # left intact and taken by a later request, judged clean before it was sent
            return False
        fd = c.getinfo(pycurl.ACTIVESOCKET)
        if fd < 0:  # not kept: libcurl closed it; unasked (a 200 on a kept-alive answer) = excess
            return t.status in (200, 206) and not t.closing  # 206: a ranged GET (direct.py's parts)
        if waiting(fd):
            conn = c.getinfo(pycurl.CONN_ID)
            sharing = [s for _, s, other in running
                       if other is not c and other.getinfo(pycurl.CONN_ID) == conn]
            for s in sharing:  # one with nothing read yet is redone by libcurl on a new connection
                s.suspect = s.headed
            _cut(fd)
            self.kept.pop(fd, None)
            self._forget(fd)
            return not sharing and t.url.startswith("http:")  # over TLS: maybe a TLS record of its own
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
                self._forget(fd)
            elif waiting(fd):
                _cut(fd)
                del self.kept[fd]
                self._forget(fd)
                cut += 1
        return cut

    def release(self, t: Any) -> None:
        """``t`` is judged or dropped: its connection's record keeps no transfer (nor its
        caller's buffer); a later request on the connection is still checked."""
        seen = self._ports.get(t.port)
        if seen is not None and seen[1] is t:
            seen[1] = None

    def _forget(self, fd: int) -> None:
        """Drop the port record of a connection that is gone (the port may carry another later)."""
        for port in [p for p, (f, _) in self._ports.items() if f == fd]:
            del self._ports[port]


__all__ = ["OVERLONG", "ConnectionWatch", "overlong_error", "waiting"]
