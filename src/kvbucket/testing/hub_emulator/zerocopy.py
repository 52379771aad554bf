"""Receive a large request body straight from the socket into a file, without Python copies.

Why: through aiohttp, every uploaded byte is copied socket -> bytes -> stream buffer -> our
buffer -> page cache, which made the emulator's CPU per uploaded GiB comparable to the client's
own chunking and hashing. On Linux, ``splice`` moves the bytes socket -> pipe -> file inside the
kernel, and the file is then verified through ``mmap`` (no copy either).

How it stays correct: the bytes aiohttp already parsed into the request's stream are written
first; the transport's reading is paused so nothing else consumes the socket; the rest of the
announced ``Content-Length`` is spliced by worker threads; the request stream is then marked
finished and the reply closes the connection, since aiohttp's HTTP parser never saw those bytes.
Used for xorb uploads only (large, one per connection slot). Elsewhere: the ordinary path.

How it stays fair (issue 24): a worker splices only while bytes flow, for at most ``_SLICE_S``
at a time; when the socket runs dry it hands the worker back and the wait for more bytes happens
on the event loop. A stalled or trickling client therefore never holds one of the few workers
that other users' requests need, and it is cut off after ``idle_s`` without a byte or when it
falls behind a minimum rate (``body_wait``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .state import Writeback, is_disk_full, preallocate, write_all
from .wire import body_wait

_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SLICE_S = 0.05  # the longest a worker splices one body before it lets other work run
_GRACE_S = 0.005  # a slice waits for a dry socket this long in all, then hands the worker back

Run = Callable[..., Awaitable[Any]]  # runs a blocking function in the CPU pool (``Emulator.cpu``)


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


async def splice_to_file(
    sock_fd: int, head: bytes, total: int, directory: Path, run: Run, idle_s: float
) -> str:
    """Write ``head`` then splice ``total - len(head)`` socket bytes into a new temp file (0600).

    Returns the temp file's path; the caller owns (and removes) it. Raises ``TimeoutError`` for
    a body that stalls ``idle_s`` or falls behind the minimum rate, ``ConnectionError`` for one
    cut short.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    sink = _Sink(fd)
    r = w = watch = -1
    job: asyncio.Future[Any] | None = None

    async def in_worker(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal job  # shielded: a cancelled request must not close the fds a worker still uses
        job = asyncio.ensure_future(run(fn, *args))
        return await asyncio.shield(job)

    def close_all(_: object = None) -> None:
        sink.close()
        for p in (r, w, watch):
            if p >= 0:
                os.close(p)

    try:
        await in_worker(sink.start, head, total)
        remaining = total - len(head)
        r, w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_SIZE)
        while remaining:
            remaining -= await in_worker(_splice_some, sock_fd, w, r, sink, remaining)
            if not remaining:
                break
            if watch < 0:
                watch = os.dup(sock_fd)  # the loop refuses a reader on a transport's own fd
            wait = body_wait(started, total - remaining, loop.time(), idle_s)
            if wait <= 0 or not await _readable(loop, watch, wait):
                raise TimeoutError(f"the body stalled or came too slowly ({remaining} bytes still due)")
        if sink.full is not None:
            raise sink.full
        return tmp
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        if job is not None and not job.done():  # cancelled mid-slice: close once the worker is done
            job.add_done_callback(lambda j: (j.cancelled() or j.exception(), close_all()))
        else:
            close_all()


class _Sink:
    """Where body bytes go: the temp file, or, once the disk is full, nowhere.

    Why: a reply sent before the body is read makes the server close a socket with unread
    bytes, which the client may see as a reset (and retry) rather than the reply. So the rest
    of the body is still received, and dropped, and the caller then answers "disk full".
    """

    def __init__(self, fd: int) -> None:
        self.file_fd = self.fd = fd
        self.full: OSError | None = None
        self.writeback = Writeback(fd)  # the disk starts writing as the body comes (see state)

    def _overflow(self, e: OSError) -> None:
        if self.full is not None or not is_disk_full(e):
            raise e
        self.full = e
        self.fd = os.open(os.devnull, os.O_WRONLY)

    def start(self, head: bytes, total: int) -> None:
        try:
            preallocate(self.fd, total)
            write_all(self.fd, head, self.writeback)
        except OSError as e:
            self._overflow(e)

    def drain(self, r: int, n: int) -> None:
        """Move ``n`` bytes from the pipe ``r`` into the sink."""
        while n:
            try:
                moved = os.splice(r, self.fd, n)
            except OSError as e:
                self._overflow(e)
                continue
            n -= moved
            if self.full is None:
                self.writeback.wrote(moved)

    def close(self) -> None:
        os.close(self.file_fd)
        if self.fd != self.file_fd:
            os.close(self.fd)


def _splice_some(sock_fd: int, w: int, r: int, sink: _Sink, remaining: int) -> int:
    """In a worker: splice socket -> pipe -> file while bytes come, for at most ``_SLICE_S``.

    Returns the bytes moved (maybe 0) when the socket was dry for ``_GRACE_S`` in all, the slice is
    used up, or the body is complete.
    """
    flags = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
    stop = time.monotonic() + _SLICE_S
    grace = _GRACE_S  # in all, per slice: a trickle of bytes gets no more of the worker than a stall
    moved = 0
    while moved < remaining:
        try:
            n = os.splice(sock_fd, w, min(remaining - moved, _PIPE_SIZE), flags=flags)
        except BlockingIOError:
            t0 = time.monotonic()
            if t0 >= stop or grace <= 0 or not _wait_readable(sock_fd, grace):
                return moved
            grace -= time.monotonic() - t0
            continue
        if n == 0:
            raise ConnectionError(f"the client closed the connection with {remaining - moved} body bytes due")
        moved += n
        sink.drain(r, n)
        if time.monotonic() >= stop:
            break
    return moved


async def _readable(loop: asyncio.AbstractEventLoop, fd: int, timeout_s: float) -> bool:
    """Wait on the event loop (no thread held) until ``fd`` has bytes; False on timeout."""
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        async with asyncio.timeout(timeout_s):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


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
