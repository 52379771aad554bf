"""The Hub REST routes for buckets: create/list/info/delete, tree, paths-info, batch, resolve."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from .auth import Caller
from .core import Emulator
from .faults import Fault
from .state import BucketRow, FileRow, now_iso
from .wire import (
    FAULT,
    LIST_PAGE,
    MAX_BATCH_LINES,
    MAX_JSON_BYTES,
    MAX_PATHS_INFO,
    TREE_PAGE,
    HubError,
    check_name,
    check_path,
    origin,
    parse_range,
    raw_segments,
    read_body,
    read_json,
)  # fmt: skip
from .xet import EMPTY_FILE_HASH_HEX, FileRecord, is_hex_hash

# the bytes [start, end) of a stored file, decoded (``CasRoutes.stream_range``)
RangeReader = Callable[[FileRecord, int, int], AsyncIterator[bytes]]

log = logging.getLogger("kvbucket.emulator")


def _not_found(bucket_id: str) -> HubError:
    return HubError(404, f"Bucket {bucket_id!r} not found (or you cannot see it)", "RepoNotFound")


def _anonymous_refused(what: str) -> HubError:
    """The Hub's answer to an anonymous caller for something it may not see: 401, and
    ``RepoNotFound`` so the client raises its not-found error (missing and private look alike)."""
    return HubError(401, f"{what}: authenticate with a token that may read it", "RepoNotFound")


class HubRoutes:
    def __init__(self, emu: Emulator, read_range: RangeReader) -> None:
        self.emu = emu
        self.state = emu.state
        self.read_range = read_range

    def caller(self, request: web.Request) -> Caller:
        c = self.emu.auth.caller(request.headers.get("Authorization"))
        if c is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return c

    def bucket(
        self, request: web.Request, bucket_id: str, *, write: bool = False
    ) -> tuple[BucketRow, Caller]:
        """The bucket if the caller may see it (and, with ``write``, change it), else the Hub's error.

        Not visible: 401 for anonymous callers, 404 for users (missing and private look alike).
        Visible but not writable: 401 anonymous, 403 outside the caller's namespaces or with a
        read-only token.
        """
        caller = self.caller(request)
        row = self.state.get_bucket(bucket_id)
        ns = bucket_id.split("/", 1)[0]
        if row is None or not caller.can_read(ns, row.private):
            if not caller.authenticated:
                raise _anonymous_refused(f"Bucket {bucket_id!r} not found (or you cannot see it)")
            raise _not_found(bucket_id)
        if write:
            self.check_write(caller, ns, f"bucket {bucket_id!r}")
        return row, caller

    @staticmethod
    def check_write(caller: Caller, ns: str, what: str) -> None:
        if not caller.authenticated:
            raise HubError(401, f"You must be authenticated with a write token to change {what}")
        if not caller.member_of(ns):
            raise HubError(403, f"You don't have the rights to change {what}: {ns!r} is not your namespace "
                           "nor one of your organisations")  # fmt: skip
        if not caller.can_write:
            raise HubError(403, f"Your token ({caller.token_name}) is read-only: it cannot change {what}")

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
        if len(segs) == 1 or segs[1] == "":
            if request.method != "GET":  # e.g. DELETE of a bucket id without a namespace
                raise HubError(404, f"Bucket {ns!r} not found: ids are 'namespace/name'", "RepoNotFound")
            return await self.list_buckets(request, ns)
        name = unquote(segs[1])
        if ns == "me" and len(segs) == 2 and request.method == "POST":
            caller = self.caller(request)
            if not caller.authenticated:
                raise HubError(401, "You must be authenticated with a write token to create a bucket")
            ns = caller.name
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
        self.check_write(caller, ns, f"namespace {ns!r}")
        visibility = body.get("visibility")
        private = body.get("private")
        if private is not None and not isinstance(private, bool):
            raise HubError(400, f"'private' must be true or false, not {private!r}")
        if visibility is None:
            visibility = "private" if private else "public"  # the Hub's default is public
        elif visibility not in ("public", "private"):
            raise HubError(400, f"visibility must be 'public' or 'private', not {visibility!r}")
        elif private is not None and private != (visibility == "private"):
            raise HubError(400, f"'private': {str(private).lower()} contradicts 'visibility': {visibility!r}")
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
            if not caller.authenticated:
                raise HubError(401, "listing your buckets ('me') needs a token")
            ns = caller.name
        search = request.query.get("search", "")
        after = request.query.get("cursor", "")
        rows = self.state.list_buckets(ns)
        if not rows and ns not in self.emu.auth.namespaces():
            # as on the Hub: an unknown namespace (e.g. a bucket id without its namespace) is a 404
            raise HubError(404, f"namespace {ns!r} not found (ids are 'namespace/name')", "RepoNotFound")
        rows = [
            r for r in rows
            if caller.can_read(ns, r.private) and search in r.id.split("/", 1)[1] and r.id > after
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
        recursive = request.query.get("recursive", "true").lower() not in ("false", "0")  # the Hub: recursive
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
        lines = [ln for ln in (await read_body(request, MAX_JSON_BYTES)).split(b"\n") if ln.strip()]
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
            if row is None or not caller.can_read(src.split("/", 1)[0], row.private):
                raise HubError(404, f"source bucket {src!r} not found (or you cannot see it)")
            if xet != EMPTY_FILE_HASH_HEX and not self.state.bucket_has_hash(src, xet):
                raise HubError(404, f"no file with hash {xet} in source bucket {src!r}")
        rec = self.state.get_reconstruction(xet)
        if rec is None or (kind == "addFile" and not self._may_add(caller, xet)):
            # the same answer for a hash one may not use: the reply never says what others store
            raise HubError(400, f"unknown xetHash {xet}: upload its xorbs and shard to the CAS first")
        ctype = op.get("contentType")
        self.state.put_file(
            bucket_id,
            FileRow(path, xet, rec.size, mtime, now, ctype if isinstance(ctype, str) else None),
        )

    def _may_add(self, caller: Caller, xet: str) -> bool:
        """Content ``caller`` uploaded (through a bucket it can read) or can already read.

        Otherwise anyone who learnt the hash of another user's private file could add it to
        their own bucket and read it. Content from elsewhere is copied with ``copyFile``,
        which names its source bucket (as the Hub's client does).
        """
        if xet == EMPTY_FILE_HASH_HEX:
            return True
        for bucket_id in self.state.buckets_reaching(xet):
            row = self.state.get_bucket(bucket_id)
            if row is not None and caller.can_read(bucket_id.split("/", 1)[0], row.private):
                return True
        return False

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
        _, caller = self.bucket(request, src, write=True)
        ns, name = dst.split("/")
        check_name(ns, "namespace")
        check_name(name, "bucket name")
        self.check_write(caller, ns, f"namespace {ns!r}")
        if not self.state.move_bucket(src, dst):
            raise HubError(409, f"bucket {dst!r} already exists")
        return web.json_response({})

    async def whoami(self, request: web.Request) -> web.StreamResponse:
        """``/api/whoami-v2`` in the Hub's shape (what ``HfApi.whoami``, ``hf auth whoami`` and
        ``login`` read: ``name``, ``type``, ``orgs[].name``, ``auth.accessToken.{displayName, role}``)."""
        c = self.caller(request)
        if not c.authenticated:
            raise HubError(401, "Invalid credentials in Authorization header")
        return web.json_response(whoami_json(c))

    async def repo_not_found(self, request: web.Request) -> web.StreamResponse:
        """Model, dataset and space repos: the emulator holds none, so every repo is not found,
        with the Hub's ``RepoNotFound`` (the client raises ``RepositoryNotFoundError``, and
        ``HfFileSystem`` a ``FileNotFoundError``); 401 for anonymous callers, as on the Hub."""
        caller = self.caller(request)
        if not caller.authenticated:
            raise _anonymous_refused("Repository not found")
        raise HubError(404, "Repository not found (the emulator holds buckets only)", "RepoNotFound")

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
        async for piece in self.read_range(rec, start, end):
            await resp.write(piece)
            sent += len(piece)
            if fault is not None and fault.drop and request.transport is not None:
                request.transport.abort()
                break
        self.emu.stats["resolve"].bytes_out += sent
        await resp.write_eof()
        return resp


_CREATED = "2025-01-01T00:00:00.000Z"


def _entity_id(kind: str, name: str) -> str:
    """A stable 24-hex-digit id, like the Hub's object ids."""
    return hashlib.sha256(f"{kind}:{name}".encode()).hexdigest()[:24]


def whoami_json(c: Caller) -> dict[str, Any]:
    role = {"write": "write", "read": "read", "fine-read": "fineGrained"}[c.scope or "read"]
    token: dict[str, Any] = {"displayName": c.token_name, "role": role, "createdAt": _CREATED}
    if role == "fineGrained":  # read-only rights on the user's and its organisations' repos
        token["fineGrained"] = {
            "canReadGatedRepos": False,
            "global": [],
            "scoped": [
                {"entity": {"_id": _entity_id(kind, n), "type": kind, "name": n},
                 "permissions": ["repo.content.read"]}
                for kind, n in [("user", c.name), *(("org", o) for o in c.orgs)]
            ],
        }  # fmt: skip
    orgs = [
        {"type": "org", "id": _entity_id("org", o), "name": o, "fullname": o, "email": None,
         "canPay": False, "periodEnd": None, "avatarUrl": "", "roleInOrg": "write", "isEnterprise": False}
        for o in c.orgs
    ]  # fmt: skip
    return {
        "type": "user", "id": _entity_id("user", c.name), "name": c.name, "fullname": c.name,
        "email": None, "emailVerified": False, "canPay": False, "periodEnd": None, "isPro": False,
        "avatarUrl": "", "orgs": orgs, "auth": {"type": "access_token", "accessToken": token},
    }  # fmt: skip
