"""The HTTP side: Hub bucket routes and Xet CAS routes, as aiohttp handlers.

Paths of objects can themselves hold ``%`` (kvbucket and LMCache percent-encode object names),
and the client quotes them again, so routes carrying an object path are parsed from the raw
request path and unquoted exactly once here, never by the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from . import zerocopy
from .auth import Auth, Caller
from .faults import Fault, FaultPlan, FaultRule
from .state import BucketRow, FileRow, State, now_iso
from .xet import (
    EMPTY_FILE_HASH_HEX,
    FileRecord,
    XetFormatError,
    decode_chunk,
    file_hash,
    hash_to_hex,
    is_hex_hash,
    parse_shard,
    range_verification_hash,
    verify_xorb,
    verify_xorb_file,
)
from .xet import MAX_XORB_BYTES as _MAX_XORB

log = logging.getLogger("kvbucket.emulator")

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
_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")

FAULT = web.RequestKey("fault", Fault)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


def _not_found(bucket_id: str) -> HubError:
    return HubError(404, f"Bucket {bucket_id!r} not found (or you cannot see it)", "RepoNotFound")


@dataclass
class RouteStats:
    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Emulator:
    """The server's live objects: durable state, auth, faults, counters and the CPU pool."""

    def __init__(
        self,
        state: State,
        auth: Auth,
        faults: FaultPlan | None = None,
        admin_key: str = "",
        zero_copy: bool = True,
    ) -> None:
        self.state = state
        self.zero_copy = zero_copy and zerocopy.supported(state.xorb_dir)
        self.auth = auth
        self.faults = faults or FaultPlan()
        self.admin_key = admin_key
        self.stats: dict[str, RouteStats] = defaultdict(RouteStats)
        self.statuses: dict[str, int] = defaultdict(int)
        self.pool = ThreadPoolExecutor(
            max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="emu"
        )
        self.started = time.monotonic()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    async def cpu(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def snapshot(self) -> dict[str, Any]:
        return {
            "routes": {k: vars(v).copy() for k, v in sorted(self.stats.items())},
            "statuses": dict(self.statuses),
            "process_cpu_s": time.process_time(),
            "loop_thread_cpu_s": time.thread_time(),
            "uptime_s": time.monotonic() - self.started,
            "pid": os.getpid(),
            "zero_copy_uploads": self.zero_copy,
        }


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def raw_segments(request: web.Request, prefix: str) -> list[str]:
    """Raw (still percent-encoded) path segments after ``prefix``."""
    raw = request.raw_path.split("?", 1)[0]
    return raw[len(prefix) :].split("/")


def check_name(part: str, what: str) -> str:
    if not _NAME_RE.match(part) or ".." in part or "--" in part:
        raise HubError(
            400,
            f"invalid {what} {part!r}: use letters, digits, '-', '_' or '.', at most 96 characters, "
            "starting and ending with a letter or digit",
        )
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


# --------------------------------------------------------------------------------------------
# routes table used by stats and faults
# --------------------------------------------------------------------------------------------
def route_name(method: str, path: str) -> str:
    if path.startswith("/cas/"):
        p = path[5:]
        if p.startswith("v1/xorbs/"):
            return "xorb_upload"
        if p.startswith("v1/xorb-grants/"):
            return "xorb_grant"
        if p.endswith("shards"):
            return "shard_upload"
        if "reconstructions" in p:
            return "reconstruction"
        if p.startswith("fetch/"):
            return "fetch"
        if p.startswith("v1/chunks/"):
            return "dedup"
        if p.startswith("v1/telemetry"):
            return "telemetry"
        return "file_chunk_hashes" if "file-chunk-hashes" in p else "cas_other"
    if path.startswith("/v1/telemetry"):
        return "telemetry"
    if path.startswith("/buckets/"):
        return "resolve"
    if path.startswith("/api/whoami"):
        return "whoami"
    if path.startswith("/api/repos/move"):
        return "move_bucket"
    if path.startswith("/api/buckets/"):
        segs = path[len("/api/buckets/") :].split("/")
        if len(segs) == 1:
            return "list_buckets"
        if len(segs) == 2:
            return {"POST": "create_bucket", "DELETE": "delete_bucket"}.get(method, "bucket_info")
        action = segs[2]
        if action.startswith("xet-"):
            return "xet_token"
        return {"settings": "bucket_settings", "paths-info": "paths_info"}.get(action, action)
    if path.startswith("/_emulator/"):
        return "control"
    return "other"


# --------------------------------------------------------------------------------------------
# middleware: stats, faults, error mapping
# --------------------------------------------------------------------------------------------
def make_middleware(emu: Emulator) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        name = route_name(request.method, request.path)
        st = emu.stats[name]
        st.requests += 1
        st.bytes_in += request.content_length or 0
        fault: Fault | None = emu.faults.check(name) if name != "control" else None
        request[FAULT] = fault
        try:
            if fault is not None:
                if fault.latency_s:
                    await asyncio.sleep(fault.latency_s)
                if fault.status is not None:
                    resp: web.StreamResponse = error_response(
                        fault.status, f"injected fault on {name}", "EmulatorFault"
                    )
                    if fault.status in (429, 503):
                        resp.headers["Retry-After"] = "0"
                    return _count(emu, st, resp)
            try:
                resp = await handler(request)
            except HubError as e:
                resp = error_response(e.status, e.message, e.code)
            except web.HTTPException:
                raise
            except Exception:
                log.exception("internal error on %s %s", request.method, name)
                resp = error_response(500, f"internal emulator error on {name}; see the server log")
            if fault is not None and fault.drop and isinstance(resp, web.Response) and resp.body:
                return await _drop_mid_body(request, resp)
            return _count(emu, st, resp)
        finally:
            if log.isEnabledFor(logging.DEBUG):
                ms = (time.perf_counter() - t0) * 1e3
                log.debug(
                    "%s %s (%d bytes in) %.1f ms", request.method, name, request.content_length or 0, ms
                )

    return middleware


def _count(emu: Emulator, st: RouteStats, resp: web.StreamResponse) -> web.StreamResponse:
    if isinstance(resp, web.Response) and resp.body is not None:
        st.bytes_out += len(resp.body)  # type: ignore[arg-type]
    emu.statuses[str(resp.status)] += 1
    return resp


async def _drop_mid_body(request: web.Request, resp: web.Response) -> web.StreamResponse:
    """Send the headers and half the body, then cut the connection (a dropped transfer).

    The request itself was processed: for uploads this plays "the reply got lost".
    """
    body = bytes(resp.body)  # type: ignore[arg-type]
    stream = web.StreamResponse(status=resp.status, headers=resp.headers)
    stream.content_length = len(body)
    await stream.prepare(request)
    await stream.write(body[: max(1, len(body) // 2)])
    if request.transport is not None:
        request.transport.abort()
    return stream


# --------------------------------------------------------------------------------------------
# Hub REST
# --------------------------------------------------------------------------------------------
class HubRoutes:
    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self.state = emu.state

    def caller(self, request: web.Request) -> Caller:
        c = self.emu.auth.caller(request.headers.get("Authorization"))
        if c is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return c

    def bucket(
        self, request: web.Request, bucket_id: str, *, write: bool = False
    ) -> tuple[BucketRow, Caller]:
        caller = self.caller(request)
        row = self.state.get_bucket(bucket_id)
        if row is None or (row.private and not caller.can_read):
            raise _not_found(bucket_id)
        if write and not caller.can_write:
            if not caller.authenticated:
                raise HubError(401, "You must be authenticated with a write token to change this bucket")
            raise HubError(403, f"Your token ({caller.name}) is read-only: it cannot write to {bucket_id!r}")
        return row, caller

    def bucket_json(self, row: BucketRow) -> dict[str, Any]:
        n, size = self.state.bucket_usage(row.id)
        return {
            "id": row.id,
            "private": row.private,
            "createdAt": row.created_at,
            "size": size,
            "totalFiles": n,
        }

    # /api/buckets/...
    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        segs = raw_segments(request, "/api/buckets/")
        ns = unquote(segs[0])
        if len(segs) == 1:
            if request.method != "GET":
                raise HubError(405, "use GET to list buckets")
            return await self.list_buckets(request, ns)
        name = unquote(segs[1])
        if ns == "me" and len(segs) == 2 and request.method == "POST":
            ns = self.caller(request).name
        bucket_id = f"{ns}/{name}"
        m = request.method
        if len(segs) == 2:
            if m == "POST":
                return await self.create_bucket(request, ns, name)
            if m == "GET":
                row, _ = self.bucket(request, bucket_id)
                return web.json_response(self.bucket_json(row))
            if m == "DELETE":
                self.bucket(request, bucket_id, write=True)
                self.state.delete_bucket(bucket_id)
                return web.json_response({})
            raise HubError(405, f"{m} is not supported on a bucket")
        action = segs[2]
        rest = "/".join(segs[3:])
        if action == "settings" and m == "PUT":
            return await self.settings(request, bucket_id)
        if action == "tree" and m == "GET":
            return await self.tree(request, bucket_id, unquote(rest))
        if action == "paths-info" and m == "POST":
            return await self.paths_info(request, bucket_id)
        if action == "batch" and m == "POST":
            return await self.batch(request, bucket_id)
        if action in ("xet-write-token", "xet-read-token") and m == "GET":
            return self.xet_token(request, bucket_id, "write" if action == "xet-write-token" else "read")
        raise HubError(404, f"no route {m} /api/buckets/{{id}}/{action}")

    async def create_bucket(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        caller = self.caller(request)
        check_name(ns, "namespace")
        check_name(name, "bucket name")
        bucket_id = f"{ns}/{name}"
        body = await read_json(request)
        if not isinstance(body, dict):
            raise HubError(400, "create_bucket expects a JSON object")
        if not caller.can_write:
            raise HubError(401 if not caller.authenticated else 403, "creating a bucket needs a write token")
        visibility = body.get("visibility", "public")
        if visibility not in ("public", "private"):
            raise HubError(400, f"visibility must be 'public' or 'private', not {visibility!r}")
        url = f"{origin(request)}/buckets/{bucket_id}"
        if not self.state.create_bucket(bucket_id, visibility == "private"):
            resp = web.json_response(
                {"error": f"You already created this bucket: {bucket_id}", "url": url}, status=409
            )
            resp.headers["X-Error-Message"] = "You already created this bucket"
            return resp
        log.info("created bucket %s (%s)", bucket_id, visibility)
        return web.json_response({"url": url, "id": bucket_id, "name": bucket_id})

    async def list_buckets(self, request: web.Request, ns: str) -> web.StreamResponse:
        caller = self.caller(request)
        if ns == "me":
            ns = caller.name
        search = request.query.get("search", "")
        after = request.query.get("cursor", "")
        rows = [
            r for r in self.state.list_buckets(ns)
            if (not r.private or caller.can_read) and search in r.id.split("/", 1)[1] and r.id > after
        ]  # fmt: skip
        page = rows[:LIST_PAGE]
        resp = web.json_response([self.bucket_json(r) for r in page])
        if len(rows) > LIST_PAGE:
            nxt = request.url.update_query(cursor=page[-1].id)
            resp.headers["Link"] = f'<{nxt}>; rel="next"'
        return resp

    async def settings(self, request: web.Request, bucket_id: str) -> web.StreamResponse:
        self.bucket(request, bucket_id, write=True)
        body = await read_json(request)
        private = body.get("private") if isinstance(body, dict) else None
        if not isinstance(private, bool):
            raise HubError(400, "settings expects {'private': true|false}")
        self.state.set_private(bucket_id, private)
        return web.json_response({})

    async def tree(self, request: web.Request, bucket_id: str, prefix: str) -> web.StreamResponse:
        self.bucket(request, bucket_id)
        recursive = request.query.get("recursive", "false").lower() in ("true", "1")
        cursor = request.query.get("cursor")
        try:
            limit = max(1, min(TREE_PAGE, int(request.query.get("limit", TREE_PAGE))))
        except ValueError:
            raise HubError(400, "limit must be an integer") from None
        out: list[dict[str, Any]] = []
        last_file: str | None = None  # the cursor: every file up to here is in this page
        more = False
        pending_dir: dict[str, Any] | None = None
        for f in self.state.iter_files(bucket_id, prefix, after=cursor):
            if recursive:
                entry = f.to_json()
            else:
                # the first '/' after the prefix (after "prefix/" when the prefix names a directory)
                base = len(prefix) + (1 if prefix and f.path[len(prefix) : len(prefix) + 1] == "/" else 0)
                slash = f.path.find("/", base)
                if slash < 0:
                    entry = f.to_json()
                elif pending_dir is not None and pending_dir["path"] == f.path[:slash]:
                    # a directory's files are contiguous in path order: fold them into its entry
                    pending_dir["uploadedAt"] = max(pending_dir["uploadedAt"], f.uploaded_at)
                    last_file = f.path
                    continue
                else:
                    entry = {"type": "directory", "path": f.path[:slash], "uploadedAt": f.uploaded_at}
            if len(out) == limit:
                more = True
                break
            out.append(entry)
            last_file = f.path
            pending_dir = entry if entry["type"] == "directory" else None
        resp = web.json_response(out)
        if more and last_file is not None:
            nxt = request.url.update_query(cursor=last_file)
            resp.headers["Link"] = f'<{nxt}>; rel="next"'
        return resp

    async def paths_info(self, request: web.Request, bucket_id: str) -> web.StreamResponse:
        self.bucket(request, bucket_id)
        body = await read_json(request)
        paths = body.get("paths") if isinstance(body, dict) else None
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise HubError(400, "paths-info expects {'paths': [str, ...]}")
        if len(paths) > MAX_PATHS_INFO:
            raise HubError(400, f"at most {MAX_PATHS_INFO} paths per paths-info request, got {len(paths)}")
        rows = self.state.get_files(bucket_id, list(dict.fromkeys(paths)))
        return web.json_response([r.to_json() for r in rows])

    async def batch(self, request: web.Request, bucket_id: str) -> web.StreamResponse:
        _, caller = self.bucket(request, bucket_id, write=True)
        if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
            raise HubError(413, f"batch body over {MAX_JSON_BYTES} bytes")
        lines = [ln for ln in (await request.read()).split(b"\n") if ln.strip()]
        if len(lines) > MAX_BATCH_LINES:
            raise HubError(400, f"at most {MAX_BATCH_LINES} operations per batch request, got {len(lines)}")
        fault: Fault | None = request.get(FAULT)
        failed: list[dict[str, str]] = []
        now = now_iso()
        with self.state.transaction():
            for i, raw in enumerate(lines, start=1):
                path = ""
                try:
                    op = json.loads(raw)
                    if not isinstance(op, dict):
                        raise HubError(400, "each batch line must be a JSON object")
                    path = op.get("path") if isinstance(op.get("path"), str) else ""
                    if fault is not None and i in fault.fail_batch_lines:
                        raise HubError(500, "injected fault on this batch line")
                    self._apply(bucket_id, caller, op, now)
                except HubError as e:
                    failed.append({"path": path, "error": e.message})
                except ValueError:
                    failed.append({"path": path, "error": f"line {i} is not valid JSON"})
        status = 422 if lines and len(failed) == len(lines) else 200
        return web.json_response({"failed": failed, "applied": len(lines) - len(failed)}, status=status)

    def _apply(self, bucket_id: str, caller: Caller, op: dict[str, Any], now: str) -> None:
        kind = op.get("type")
        path = op.get("path")
        if not isinstance(path, str):
            raise HubError(400, "missing 'path'")
        why = check_path(path)
        if why:
            raise HubError(400, f"invalid path: {why}")
        if kind == "deleteFile":
            self.state.delete_file(bucket_id, path)  # deleting a missing file is a no-op, as in S3
            return
        if kind not in ("addFile", "copyFile"):
            raise HubError(400, f"unknown operation type {kind!r} (addFile, copyFile or deleteFile)")
        xet = op.get("xetHash")
        if not isinstance(xet, str) or not is_hex_hash(xet):
            raise HubError(400, "'xetHash' must be a 64-digit hex Xet file hash")
        mtime = op.get("mtime", int(time.time() * 1000))
        if not isinstance(mtime, int) or isinstance(mtime, bool) or mtime < 0:
            raise HubError(400, "'mtime' must be milliseconds since the epoch (an integer)")
        if kind == "copyFile":
            if op.get("sourceRepoType") != "bucket":
                raise HubError(400, "the emulator copies between buckets only (sourceRepoType 'bucket')")
            src = op.get("sourceRepoId")
            if not isinstance(src, str):
                raise HubError(400, "missing 'sourceRepoId'")
            row = self.state.get_bucket(src)
            if row is None or (row.private and not caller.can_read):
                raise HubError(404, f"source bucket {src!r} not found")
            if xet != EMPTY_FILE_HASH_HEX and not self.state.bucket_has_hash(src, xet):
                raise HubError(404, f"no file with hash {xet} in source bucket {src!r}")
        rec = self.state.get_reconstruction(xet)
        if rec is None:
            raise HubError(400, f"unknown xetHash {xet}: upload its xorbs and shard to the CAS first")
        ctype = op.get("contentType")
        self.state.put_file(
            bucket_id,
            FileRow(path, xet, rec.size, mtime, now, ctype if isinstance(ctype, str) else None),
        )

    def xet_token(self, request: web.Request, bucket_id: str, scope: str) -> web.StreamResponse:
        self.bucket(request, bucket_id, write=scope == "write")
        token, exp = self.emu.auth.issue_xet_token(bucket_id, scope)  # type: ignore[arg-type]
        cas = f"{origin(request)}/cas"
        headers = {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(exp)}
        return web.json_response({"accessToken": token, "exp": exp, "casUrl": cas}, headers=headers)

    async def move(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if not isinstance(body, dict) or body.get("type") != "bucket":
            raise HubError(400, "the emulator moves buckets only: {'fromRepo', 'toRepo', 'type': 'bucket'}")
        src, dst = body.get("fromRepo"), body.get("toRepo")
        if not isinstance(src, str) or not isinstance(dst, str) or dst.count("/") != 1:
            raise HubError(400, "'fromRepo' and 'toRepo' must be bucket ids (namespace/name)")
        self.bucket(request, src, write=True)
        ns, name = dst.split("/")
        check_name(ns, "namespace")
        check_name(name, "bucket name")
        if not self.state.move_bucket(src, dst):
            raise HubError(409, f"bucket {dst!r} already exists")
        return web.json_response({})

    async def whoami(self, request: web.Request) -> web.StreamResponse:
        c = self.caller(request)
        if not c.authenticated and not self.emu.auth.open:
            raise HubError(401, "Invalid credentials in Authorization header")
        role = "write" if c.can_write else "read"
        return web.json_response(
            {"type": "user", "name": c.name, "fullname": c.name, "orgs": [],
             "auth": {"type": "access_token", "accessToken": {"displayName": c.name, "role": role}}}
        )  # fmt: skip

    # /buckets/{ns}/{name}/resolve/{path}
    async def resolve(self, request: web.Request) -> web.StreamResponse:
        segs = raw_segments(request, "/buckets/")
        if len(segs) < 4 or segs[2] != "resolve":
            raise HubError(404, "expected /buckets/{namespace}/{name}/resolve/{path}")
        bucket_id = f"{unquote(segs[0])}/{unquote(segs[1])}"
        path = unquote("/".join(segs[3:]))
        self.bucket(request, bucket_id)
        rows = self.state.get_files(bucket_id, [path])
        if not rows:
            raise HubError(404, f"{path!r} not found in bucket {bucket_id!r}", "EntryNotFound")
        f = rows[0]
        refresh = f"{origin(request)}/api/buckets/{bucket_id}/xet-read-token"
        headers = {
            "X-Xet-Hash": f.xet_hash,
            "X-Xet-Refresh-Route": refresh,
            "Link": f'<{refresh}>; rel="xet-auth"',
            "X-Linked-Size": str(f.size),
            "ETag": f'"{f.xet_hash}"',
            "Accept-Ranges": "bytes",
            "Content-Type": f.content_type or "application/octet-stream",
        }
        if request.method == "HEAD":
            # a HEAD reply carries the size of the GET body it stands for
            return web.Response(status=200, headers={**headers, "Content-Length": str(f.size)})
        rng = parse_range(request.headers.get("Range"), f.size) if f.size else None
        start, end = rng if rng else (0, f.size)
        rec = self.state.get_reconstruction(f.xet_hash)
        if rec is None:
            raise HubError(500, f"file record for {f.xet_hash} is missing from the CAS index")
        resp = web.StreamResponse(status=206 if rng else 200, headers=headers)
        resp.content_length = end - start
        if rng:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        await resp.prepare(request)
        fault: Fault | None = request.get(FAULT)
        sent = 0
        async for piece in self.emu_cas.stream_range(rec, start, end):
            await resp.write(piece)
            sent += len(piece)
            if fault is not None and fault.drop and request.transport is not None:
                request.transport.abort()
                break
        self.emu.stats["resolve"].bytes_out += sent
        await resp.write_eof()
        return resp

    emu_cas: CasRoutes


# --------------------------------------------------------------------------------------------
# Xet CAS
# --------------------------------------------------------------------------------------------
class CasRoutes:
    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self.state = emu.state

    def token(self, request: web.Request, write: bool) -> tuple[str, str]:
        got = self.emu.auth.check_xet_token(request.headers.get("Authorization"))
        if got is None:
            raise HubError(401, "missing, invalid or expired Xet access token; fetch a new one from the Hub")
        if write and got[1] != "write":
            raise HubError(403, "this Xet token is read-only")
        return got

    async def xorb_grant(self, request: web.Request) -> web.StreamResponse:
        raise HubError(404, "xorb grants are not offered; upload with POST /v1/xorbs")

    async def no_dedup(self, request: web.Request) -> web.StreamResponse:
        raise HubError(404, "no global deduplication in the emulator")

    async def upload_xorb(self, request: web.Request) -> web.StreamResponse:
        self.token(request, write=True)
        xorb_hex = request.match_info["hash"]
        if not is_hex_hash(xorb_hex):
            raise HubError(400, "the xorb hash in the URL must be 64 hex digits")
        n = request.content_length
        if n is not None and n > _MAX_XORB:
            raise HubError(413, f"xorb body over {_MAX_XORB} bytes")
        sock_fd = zerocopy.socket_fd(request) if self.emu.zero_copy and (n or 0) >= ZERO_COPY_MIN else None
        if sock_fd is not None:
            return await self._upload_xorb_spliced(request, xorb_hex, sock_fd)
        data = await read_body(request, _MAX_XORB)
        if self.state.has_xorb(xorb_hex):
            return web.json_response({"was_inserted": False})
        try:
            idx = await self.emu.cpu(verify_xorb, data, xorb_hex)
        except XetFormatError as e:
            log.warning("refused xorb %s: %s", xorb_hex, e)
            raise HubError(400, f"xorb refused: {e}", "InvalidXorb") from None
        inserted = await self.emu.cpu(self.state.put_xorb, idx, data)
        return web.json_response({"was_inserted": inserted})

    async def _upload_xorb_spliced(
        self, request: web.Request, xorb_hex: str, sock_fd: int
    ) -> web.StreamResponse:
        """The zero-copy path (see ``zerocopy``): every reply closes the connection."""
        n = request.content_length
        assert n is not None
        head = zerocopy.take_body(request)
        tmp: str | None = None
        try:
            tmp = await self.emu.cpu(
                zerocopy.splice_to_file, sock_fd, head, n, self.state.xorb_dir, BODY_TIMEOUT_S
            )
            if self.state.has_xorb(xorb_hex):
                resp: web.StreamResponse = web.json_response({"was_inserted": False})
            else:
                idx = await self.emu.cpu(verify_xorb_file, tmp, xorb_hex)
                inserted = await self.emu.cpu(self.state.put_xorb_file, idx, tmp)
                resp = web.json_response({"was_inserted": inserted})
        except XetFormatError as e:
            log.warning("refused xorb %s: %s", xorb_hex, e)
            resp = error_response(400, f"xorb refused: {e}", "InvalidXorb")
        except (OSError, TimeoutError, ConnectionError) as e:
            log.warning("xorb %s: body not received: %s", xorb_hex, e)
            resp = error_response(400, f"the xorb body was not received in full: {e}")
        except Exception:
            log.exception("internal error receiving xorb %s", xorb_hex)
            resp = error_response(500, "internal emulator error on xorb_upload; see the server log")
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # already renamed when stored
        return zerocopy.finish(request, resp)

    def _verify_shard(self, data: bytes) -> list[FileRecord]:
        shard = parse_shard(data)
        for x in shard.xorbs:
            idx = self.state.get_xorb(x.hash_hex)
            if idx is None:
                raise XetFormatError(f"shard references unknown xorb {x.hash_hex}")
            if x.chunk_hashes != idx.chunk_hashes or x.unpacked_lens != idx.unpacked_lens:
                raise XetFormatError(f"shard's chunk list for xorb {x.hash_hex} does not match the xorb")
        for f in shard.files:
            chunks: list[tuple[bytes, int]] = []
            for k, s in enumerate(f.segments):
                idx = self.state.get_xorb(s.xorb_hex)
                if idx is None:
                    raise XetFormatError(f"file {f.hash_hex} references unknown xorb {s.xorb_hex}")
                if not 0 <= s.chunk_start < s.chunk_end <= idx.n_chunks:
                    raise XetFormatError(
                        f"file {f.hash_hex} uses chunks [{s.chunk_start}, {s.chunk_end}) of xorb "
                        f"{s.xorb_hex}, which has {idx.n_chunks}"
                    )
                lens = idx.unpacked_lens[s.chunk_start : s.chunk_end]
                if sum(lens) != s.unpacked_bytes:
                    raise XetFormatError(
                        f"file {f.hash_hex} claims {s.unpacked_bytes} bytes from xorb {s.xorb_hex} "
                        f"chunks [{s.chunk_start}, {s.chunk_end}), which hold {sum(lens)}"
                    )
                hashes = idx.chunk_hashes[s.chunk_start : s.chunk_end]
                if f.verification is not None and f.verification[k] != range_verification_hash(hashes):
                    raise XetFormatError(
                        f"file {f.hash_hex}: verification hash of segment {k} does not match"
                    )
                chunks.extend(zip(hashes, lens, strict=True))
            if hash_to_hex(file_hash(chunks)) != f.hash_hex:
                raise XetFormatError(f"file {f.hash_hex}: its chunks hash to a different file hash")
        return shard.files

    async def upload_shard(self, request: web.Request) -> web.StreamResponse:
        self.token(request, write=True)
        if request.content_length is not None and request.content_length > MAX_SHARD_BYTES:
            raise HubError(413, f"shard body over {MAX_SHARD_BYTES} bytes")
        data = bytes(await read_body(request, MAX_SHARD_BYTES))
        try:
            files = await self.emu.cpu(self._verify_shard, data)
        except XetFormatError as e:
            log.warning("refused shard: %s", e)
            raise HubError(400, f"shard refused: {e}", "InvalidShard") from None
        await self.emu.cpu(self.state.put_reconstructions, files)
        if request.path.startswith("/cas/v2/"):
            frames = [
                {"type": "validating", "verified": len(files), "total": len(files)},
                {"type": "result"},
            ]
            body = "".join(json.dumps(f) + "\n" for f in frames)
            return web.Response(body=body.encode(), content_type="application/x-ndjson")
        return web.json_response({"result": 1})

    async def reconstruction(self, request: web.Request) -> web.StreamResponse:
        bucket_id, _ = self.token(request, write=False)
        file_hex = request.match_info["hash"]
        if not is_hex_hash(file_hex):
            raise HubError(400, "the file hash in the URL must be 64 hex digits")
        rec = self.state.get_reconstruction(file_hex)
        if rec is None or (
            file_hex != EMPTY_FILE_HASH_HEX and not self.state.bucket_has_hash(bucket_id, file_hex)
        ):
            raise HubError(404, f"file {file_hex} not found")
        size = rec.size
        header = request.headers.get("Range")
        if header:
            if size == 0:
                start, end = 0, 0
            else:
                start, end = parse_range(header, size)  # type: ignore[misc]
        else:
            start, end = 0, size
        v2 = request.path.startswith("/cas/v2/")
        return web.json_response(self.plan(request, rec, start, end, v2))

    def plan(self, request: web.Request, rec: FileRecord, start: int, end: int, v2: bool) -> dict[str, Any]:
        """Terms covering [start, end) of the file plus where to fetch each xorb's bytes."""
        terms: list[dict[str, Any]] = []
        spans: dict[str, list[list[int]]] = {}  # xorb -> [[chunk_start, chunk_end, byte_start, byte_end)]
        pos = 0
        offset_into_first = 0
        for s in rec.segments:
            seg_end = pos + s.unpacked_bytes
            if seg_end <= start or pos >= end:
                pos = seg_end
                continue
            idx = self.state.get_xorb(s.xorb_hex)
            assert idx is not None  # shards are only accepted when their xorbs exist
            cs, ce, n = s.chunk_start, s.chunk_end, s.unpacked_bytes
            while pos + idx.unpacked_lens[cs] <= start:
                pos += idx.unpacked_lens[cs]
                n -= idx.unpacked_lens[cs]
                cs += 1
            if not terms:
                offset_into_first = start - pos
            while pos + n - idx.unpacked_lens[ce - 1] >= end:
                n -= idx.unpacked_lens[ce - 1]
                ce -= 1
            terms.append({"hash": s.xorb_hex, "unpacked_length": n, "range": {"start": cs, "end": ce}})
            spans.setdefault(s.xorb_hex, []).append([cs, ce, idx.byte_offsets[cs], idx.byte_offsets[ce]])
            pos = seg_end
        exp = int(time.time()) + FETCH_URL_TTL_S
        base = origin(request)
        fetch: dict[str, list[dict[str, Any]]] = {}
        for xorb_hex, ranges in spans.items():
            ranges.sort()
            merged: list[list[int]] = []
            for r in ranges:
                if merged and r[0] <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], r[1])
                    merged[-1][3] = max(merged[-1][3], r[3])
                else:
                    merged.append(list(r))
            url = f"{base}/cas/fetch/{xorb_hex}?e={exp}&s={self.emu.auth.sign_fetch(xorb_hex, exp)}"
            if v2:
                fetch[xorb_hex] = [
                    {"url": url, "ranges": [{"chunks": {"start": m[0], "end": m[1]},
                                             "bytes": {"start": m[2], "end": m[3] - 1}}]}
                    for m in merged
                ]  # fmt: skip
            else:
                fetch[xorb_hex] = [
                    {"range": {"start": m[0], "end": m[1]}, "url": url,
                     "url_range": {"start": m[2], "end": m[3] - 1}}
                    for m in merged
                ]  # fmt: skip
        out: dict[str, Any] = {"offset_into_first_range": offset_into_first, "terms": terms}
        out["xorbs" if v2 else "fetch_info"] = fetch
        return out

    async def fetch(self, request: web.Request) -> web.StreamResponse:
        xorb_hex = request.match_info["hash"]
        if not is_hex_hash(xorb_hex) or not self.emu.auth.check_fetch(
            xorb_hex, request.query.get("e", ""), request.query.get("s", "")
        ):
            raise HubError(403, "fetch URL is invalid or expired; ask for a new reconstruction")
        path = self.state.xorb_path(xorb_hex)
        size = path.stat().st_size if path.exists() else None
        if size is None:
            raise HubError(404, f"xorb {xorb_hex} not found")
        rng = parse_range(request.headers.get("Range"), size)
        start, end = rng if rng else (0, size)
        fault: Fault | None = request.get(FAULT)
        if fault is None or not fault.drop:
            return await self._sendfile(request, str(path), start, end, size, rng is not None)
        data = await self.emu.cpu(_pread, str(path), start, end - start)
        headers = {"Content-Range": f"bytes {start}-{end - 1}/{size}"} if rng else {}
        return web.Response(
            body=data, status=206 if rng else 200, headers=headers, content_type="application/octet-stream"
        )

    async def _sendfile(
        self, request: web.Request, path: str, start: int, end: int, size: int, partial: bool
    ) -> web.StreamResponse:
        """The common fetch path: the kernel copies the file range to the socket (sendfile).

        Done here rather than with ``web.FileResponse``, whose stat/open round trips through a
        thread pool cost more CPU than the transfer of a 2 MiB range itself.
        """
        resp = web.StreamResponse(status=206 if partial else 200)
        resp.content_type = "application/octet-stream"
        resp.content_length = end - start
        if partial:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        with open(path, "rb") as f:  # a local, usually page-cached file: no need for a thread
            await resp.prepare(request)
            if request.transport is None:
                raise ConnectionResetError("the client went away")
            try:
                await asyncio.get_running_loop().sendfile(request.transport, f, start, end - start)
            except NotImplementedError:
                f.seek(start)
                await resp.write(f.read(end - start))
        await resp.write_eof()
        self.emu.stats["fetch"].bytes_out += end - start
        return resp

    async def stream_range(self, rec: FileRecord, start: int, end: int) -> Any:
        """Yield the file's bytes [start, end), reading and decoding only the chunks that overlap.

        Chunks are read in windows of at most ~8 MiB of stored bytes, so a small range read of a
        huge file costs a few chunks, and a full read never holds a whole xorb in memory.
        """
        pos = 0
        for s in rec.segments:
            if pos >= end:
                break
            seg_end = pos + s.unpacked_bytes
            if seg_end <= start:
                pos = seg_end
                continue
            idx = self.state.get_xorb(s.xorb_hex)
            assert idx is not None
            path = str(self.state.xorb_path(s.xorb_hex))
            c = s.chunk_start
            while c < s.chunk_end and pos + idx.unpacked_lens[c] <= start:  # skip chunks before start
                pos += idx.unpacked_lens[c]
                c += 1
            while c < s.chunk_end and pos < end:
                # the window: chunks from c while under the byte budget and before `end`
                w_end, upos = c, pos
                while (
                    w_end < s.chunk_end
                    and upos < end
                    and (w_end == c or idx.byte_offsets[w_end + 1] - idx.byte_offsets[c] <= _READ_WINDOW)
                ):
                    upos += idx.unpacked_lens[w_end]
                    w_end += 1
                lo = idx.byte_offsets[c]
                raw = await self.emu.cpu(_pread, path, lo, idx.byte_offsets[w_end] - lo)
                for k in range(c, w_end):
                    ulen = idx.unpacked_lens[k]
                    off = idx.byte_offsets[k] - lo
                    clen = int.from_bytes(raw[off + 1 : off + 4], "little")
                    data = decode_chunk(raw[off + 4], raw[off + 8 : off + 8 + clen], ulen)
                    yield data[max(0, start - pos) : min(ulen, end - pos)]
                    pos += ulen
                c = w_end
            pos = seg_end


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# control routes
# --------------------------------------------------------------------------------------------
class ControlRoutes:
    def __init__(self, emu: Emulator) -> None:
        self.emu = emu

    def _admin(self, request: web.Request) -> None:
        if self.emu.admin_key and request.headers.get("X-Emulator-Admin") != self.emu.admin_key:
            raise HubError(403, "fault control needs the emulator's admin key (X-Emulator-Admin)")

    async def stats(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.emu.snapshot())

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def faults(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        if request.method == "DELETE":
            self.emu.faults.reset()
        elif request.method == "POST":
            body = await read_json(request)
            rules = body if isinstance(body, list) else [body]
            try:
                parsed = [FaultRule(**r) for r in rules]
            except (TypeError, ValueError) as e:
                raise HubError(400, f"bad fault rule: {e}") from None
            for r in parsed:
                self.emu.faults.add(r)
        return web.json_response(self.emu.faults.describe())


async def not_found(request: web.Request) -> web.StreamResponse:
    log.info("no route for %s %s", request.method, request.path)
    raise HubError(404, f"no route {request.method} {request.path} in the emulator")


def build_app(emu: Emulator) -> web.Application:
    app = web.Application(middlewares=[make_middleware(emu)], client_max_size=_MAX_XORB + 1024 * 1024)
    hub, cas, ctl = HubRoutes(emu), CasRoutes(emu), ControlRoutes(emu)
    hub.emu_cas = cas
    r = app.router
    r.add_get("/api/whoami-v2", hub.whoami)
    r.add_post("/api/repos/move", hub.move)
    r.add_route("*", "/api/buckets/{tail:.+}", hub.dispatch)
    r.add_get("/buckets/{tail:.+}", hub.resolve)  # add_get also answers HEAD
    r.add_post("/cas/v1/xorb-grants/{prefix}/{hash}", cas.xorb_grant)
    r.add_post("/cas/v1/xorbs/{prefix}/{hash}", cas.upload_xorb)
    r.add_post("/cas/v1/shards", cas.upload_shard)
    r.add_post("/cas/v2/shards", cas.upload_shard)
    r.add_get("/cas/v1/reconstructions/{hash}", cas.reconstruction)
    r.add_get("/cas/v2/reconstructions/{hash}", cas.reconstruction)
    r.add_get("/cas/fetch/{hash}", cas.fetch)
    r.add_get("/cas/v1/chunks/{prefix}/{hash}", cas.no_dedup)
    r.add_get("/cas/v2/file-chunk-hashes/{hash}", cas.no_dedup)
    r.add_post("/cas/v1/telemetry", _empty_ok)
    r.add_post("/v1/telemetry", _empty_ok)  # hf_xet posts telemetry here, outside the CAS URL
    r.add_get("/_emulator/stats", ctl.stats)
    r.add_get("/_emulator/health", ctl.health)
    r.add_route("*", "/_emulator/faults", ctl.faults)
    r.add_route("*", "/{tail:.*}", not_found)
    return app


async def _empty_ok(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.json_response({})


__all__ = ["Emulator", "HubError", "build_app"]
