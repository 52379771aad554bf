"""Receive a large request body straight from the socket into a file, without Python copies.

Why: through aiohttp, every uploaded byte is copied socket -> bytes -> stream buffer -> our
buffer -> page cache, which made the emulator's CPU per uploaded GiB comparable to the client's
own chunking and hashing. On Linux, ``splice`` moves the bytes socket -> pipe -> file inside the
kernel, and the file is then verified through ``mmap`` (no copy either).

How it stays correct: the bytes aiohttp already parsed into the request's stream are written
first; the transport's reading is paused so nothing else consumes the socket; the rest of the
announced ``Content-Length`` is spliced by a worker thread; the request stream is then marked
finished and the reply closes the connection, since aiohttp's HTTP parser never saw those bytes.
Used for xorb uploads only (large, one per connection slot). Elsewhere: the ordinary path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from .state import preallocate

_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def supported(directory: Path) -> bool:
    """Can this platform splice into files of ``directory``? (checked once at start-up)"""
    if sys.platform != "linux" or not hasattr(os, "splice"):
        return False
    r, w = os.pipe()
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-splice-")
        try:
            os.write(w, b"probe")
            return os.splice(r, fd, 5) == 5
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(tmp)
    finally:
        os.close(r)
        os.close(w)


def socket_fd(request: web.Request) -> int | None:
    """The request's plain TCP socket, if the body can be taken from it directly."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        return None
    if request.content_length is None or "Transfer-Encoding" in request.headers:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return int(sock.fileno())


def take_body(request: web.Request) -> bytes:
    """Stop aiohttp reading the socket; return the body bytes it had already buffered."""
    head = request.content.read_nowait(-1)  # may resume reading (flow control) ...
    assert request.transport is not None
    request.transport.pause_reading()  # ... so pause after it
    return head


def splice_to_file(sock_fd: int, head: bytes, total: int, directory: Path, timeout_s: float) -> str:
    """Write ``head`` then splice ``total - len(head)`` socket bytes into a new temp file (0600).

    Runs in a worker thread. Returns the temp file's path; the caller owns (and removes) it.
    """
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    r = w = -1
    try:
        preallocate(fd, total)
        view = memoryview(head)
        while view:
            view = view[os.write(fd, view) :]
        remaining = total - len(head)
        r, w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_SIZE)
        flags = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
        while remaining:
            try:
                n = os.splice(sock_fd, w, min(remaining, _PIPE_SIZE), flags=flags)
            except BlockingIOError:
                if not _wait_readable(sock_fd, timeout_s):
                    raise TimeoutError(
                        f"no body bytes for {timeout_s:.0f} s ({remaining} still due)"
                    ) from None
                continue
            if n == 0:
                raise ConnectionError(f"the client closed the connection with {remaining} body bytes due")
            remaining -= n
            while n:  # drain the pipe into the file
                n -= os.splice(r, fd, n)
        return tmp
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
        for p in (r, w):
            if p >= 0:
                os.close(p)


def finish(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """After a spliced body: the stream is complete, and the connection must not be reused."""
    request.content.feed_eof()
    resp.force_close()
    return resp


def _wait_readable(fd: int, timeout_s: float) -> bool:
    """Wait until ``fd`` has bytes. poll(), not select(): select() fails for fds >= 1024,
    which an emulator running inside a busy process (many open files) reaches."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(timeout_s * 1000))
