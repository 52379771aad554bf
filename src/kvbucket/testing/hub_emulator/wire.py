"""What goes over the wire: error replies, request bodies, ranges, and the Hub's name rules.

Paths of objects can themselves hold ``%`` (kvbucket and LMCache percent-encode object names),
and the client quotes them again, so routes carrying an object path are parsed from the raw
request path and unquoted exactly once (``raw_segments``), never by the router.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from aiohttp import web

from .auth import hub_name_problem
from .faults import Fault

MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_SHARD_BYTES = 64 * 1024 * 1024
MAX_BATCH_LINES = 1000
MAX_PATHS_INFO = 1000
MAX_PATH_LEN = 4096
TREE_PAGE = 1000
LIST_PAGE = 100
FETCH_URL_TTL_S = 3600
_READ_WINDOW = 8 * 1024 * 1024
ZERO_COPY_MIN = 1024 * 1024  # smaller xorb bodies take the ordinary path
BODY_TIMEOUT_S = 30.0  # the longest a request body may go without a byte
MIN_BODY_RATE = 256 * 1024  # bytes/s: a body must also keep this pace, after its first BODY_TIMEOUT_S
LINGER_S = 1.0  # how long the rest of a refused body is read and dropped before the connection closes
STOP_GRACE_S = 1.0  # a stop waits this long for requests in flight, then as long for their cancelling
MAX_SMALL_BODY = 1024 * 1024  # routes that take no body worth keeping (telemetry)

FAULT = web.RequestKey("fault", Fault)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


def body_timeout(request: web.Request) -> float:
    return request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)


def body_wait(started: float, got: int, now: float, idle_s: float) -> float:
    """How long to wait for a body's next bytes, having ``got`` since ``started``; <= 0: give up.

    At most ``idle_s`` without a byte, and the body must keep pace with ``MIN_BODY_RATE`` after
    its first ``idle_s``: a trickle of bytes is a stall too, whatever size it announced.
    """
    return min(idle_s, started + idle_s + got / MIN_BODY_RATE - now)


class HubError(Exception):
    """An error reply: status, message for the user, and the Hub's ``X-Error-Code`` if any."""

    def __init__(self, status: int, message: str, code: str | None = None, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.close = close  # the body was not read to its end: the connection cannot be reused


def error_response(status: int, message: str, code: str | None = None) -> web.Response:
    headers = {"X-Error-Message": message.encode("ascii", "replace").decode()[:500]}
    if code:
        headers["X-Error-Code"] = code
    return web.json_response({"error": message}, status=status, headers=headers)


def origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def raw_segments(request: web.Request, prefix: str) -> list[str]:
    """Raw (still percent-encoded) path segments after ``prefix``."""
    raw = request.raw_path.split("?", 1)[0]
    return raw[len(prefix) :].split("/")


def check_name(part: str, what: str) -> str:
    """``part`` if it is a valid Hub namespace or bucket name (the Hub's rules), else a 400."""
    why = hub_name_problem(part)
    if why:
        raise HubError(400, f"invalid {what} {part!r}: {why}")
    return part


def check_path(path: str) -> str | None:
    """Why an object path is unacceptable, or None if it is fine."""
    if not path:
        return "the path is empty"
    if len(path) > MAX_PATH_LEN:
        return f"the path is longer than {MAX_PATH_LEN} characters"
    if path.startswith("/") or path.endswith("/"):
        return "the path must not start or end with '/'"
    if "\x00" in path or any(ord(c) < 32 for c in path):
        return "the path holds control characters"
    if any(seg in ("", ".", "..") for seg in path.split("/")):
        return "the path holds an empty, '.' or '..' segment"
    return None


async def read_json(request: web.Request, cap: int = MAX_JSON_BYTES) -> Any:
    body = await read_body(request, cap)
    try:
        return json.loads(body) if body else {}
    except ValueError:
        raise HubError(400, "request body is not valid JSON") from None


# A full disk is answered with a status hf_xet does not retry: its retry policy (reqwest_retry's
# default, in xet-core's RetryWrapper) retries every 5xx and 408/429, so 500 or 507 made an
# upload retry for minutes (measured: 507 on xorb uploads, 6 attempts over 137 s); any other
# 4xx fails the upload at once. 413 ("more than the server is able to process") is the closest.
DISK_FULL_STATUS = 413


def disk_full(what: str) -> HubError:
    return HubError(
        DISK_FULL_STATUS,
        f"the emulator's disk is full: no space to store {what}; free space in its data dir, then retry",
        "InsufficientStorage",
    )


def too_large(cap: int) -> HubError:
    return HubError(413, f"request body over {cap} bytes", "PayloadTooLarge", close=True)


async def read_body(request: web.Request, cap: int) -> bytearray:
    """The request body, at most ``cap`` bytes whatever the transfer encoding, else a quick 413.

    A body that goes ``body_timeout`` seconds without a byte, or arrives slower than
    ``MIN_BODY_RATE``, is answered 408. Waiting happens on the event loop, never in a worker
    thread, so a stalled client holds nothing that other users need. With a ``Content-Length``
    the body goes into one preallocated buffer (no regrowth, no final copy).
    """
    n = request.content_length
    if n is not None and n > cap:
        raise too_large(cap)
    idle_s = body_timeout(request)
    loop = asyncio.get_running_loop()
    started = loop.time()
    buf = bytearray(0 if n is None else n)
    view = memoryview(buf) if n is not None else None  # (a viewed bytearray cannot grow)
    pos = 0
    while True:
        wait = body_wait(started, pos, loop.time(), idle_s)
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                chunk = await request.content.readany()
        except TimeoutError:
            raise HubError(408, f"request body too slow or stalled after {pos} bytes", close=True) from None
        if not chunk:
            break
        if n is None:
            if pos + len(chunk) > cap:
                raise too_large(cap)
            buf += chunk
        else:
            if pos + len(chunk) > n:
                raise HubError(400, "request body is longer than its Content-Length", close=True)
            view[pos : pos + len(chunk)] = chunk  # type: ignore[index]
        pos += len(chunk)
    if n is not None and pos < n:
        raise HubError(400, f"request body ended after {pos} of the {n} bytes announced", close=True)
    return buf


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Single ``bytes=`` range -> (start, end exclusive); None if no header; HubError 416/400."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise HubError(416, "only one 'bytes=' range is supported")
    a, _, b = spec.strip().partition("-")
    try:
        if a == "":
            n = int(b)
            start, end = max(0, size - n), size
        else:
            start = int(a)
            end = min(size, int(b) + 1) if b else size
    except ValueError:
        raise HubError(416, f"malformed Range header {header!r}") from None
    if start >= size or end <= start:
        raise HubError(416, f"range {header!r} is outside the {size} bytes of the object")
    return start, end


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
