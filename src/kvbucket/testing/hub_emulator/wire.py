"""What goes over the wire: error replies, request bodies, ranges, and the Hub's name rules.

Paths of objects can themselves hold ``%`` (kvbucket and LMCache percent-encode object names),
and the client quotes them again, so routes carrying an object path are parsed from the raw
request path and unquoted exactly once (``raw_segments``), never by the router.
"""

from __future__ import annotations

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
BODY_TIMEOUT_S = 60.0

FAULT = web.RequestKey("fault", Fault)


class HubError(Exception):
    """An error reply: status, message for the user, and the Hub's ``X-Error-Code`` if any."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


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


async def read_json(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
        raise HubError(413, f"request body over {MAX_JSON_BYTES} bytes")
    body = await request.read()
    try:
        return json.loads(body) if body else {}
    except ValueError:
        raise HubError(400, "request body is not valid JSON") from None


async def read_body(request: web.Request, cap: int) -> bytearray:
    """Read a request body into one preallocated buffer (no regrowth, no final copy)."""
    n = request.content_length
    if n is None:
        data = await request.read()  # chunked upload: bounded by the app's client_max_size
        if len(data) > cap:
            raise HubError(413, f"request body over {cap} bytes")
        return bytearray(data)
    if n > cap:
        raise HubError(413, f"request body over {cap} bytes")
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        chunk = await request.content.readany()
        if not chunk:
            raise HubError(400, f"request body ended after {pos} of the {n} bytes announced")
        if pos + len(chunk) > n:
            raise HubError(400, "request body is longer than its Content-Length")
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
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
