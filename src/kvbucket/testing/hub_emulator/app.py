"""The emulator's HTTP application: live objects, middleware (stats, faults, errors), routing.

The routes themselves live in ``hub_routes`` (Hub REST), ``cas_routes`` (Xet CAS) and, for the
control routes (stats, faults, health), here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .cas_routes import CasRoutes
from .core import Emulator, RouteStats
from .faults import Fault, FaultRule, set_json
from .hub_routes import HubRoutes
from .request_log import digest
from .state import is_disk_full
from .wire import (
    BODY_TIMEOUT,
    FAULT,
    MAX_SMALL_BODY,
    HubError,
    disk_full,
    error_response,
    read_body,
    read_json,
)
from .xet import MAX_XORB_BYTES as _MAX_XORB

log = logging.getLogger("kvbucket.emulator")

HUB = web.AppKey("hub", HubRoutes)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        started = time.monotonic()
        name = route_name(request.method, request.path)
        seq_in = emu.requests.arrived()
        answer: web.StreamResponse | None = None
        st = emu.stats[name]
        st.requests += 1
        st.bytes_in += request.content_length or 0
        if request.transport is not None and request.transport.get_extra_info("sslcontext") is not None:
            st.tls += 1
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
                resp = answer = await handler(request)
            except HubError as e:
                resp = error_response(e.status, e.message, e.code)
                if e.close:
                    resp.force_close()
            except web.HTTPException:
                raise
            except ConnectionError as e:  # the client went away mid-answer (a reset, a closed socket)
                log.debug("%s %s: the client disconnected before the answer was sent (%s)",
                          request.method, name, type(e).__name__)
                if request.transport is not None:
                    request.transport.close()  # nothing more is sent on it (an answer had begun)
                resp = error_response(499, "the client closed the connection")  # nginx's code for it
                resp.force_close()  # aiohttp finds the connection gone and drops it quietly
            except Exception as e:
                if is_disk_full(e):
                    log.error("disk full on %s %s: %s", request.method, name, e)
                    err = disk_full(f"this {name} request")
                    resp = error_response(err.status, err.message, err.code)
                else:
                    log.exception("internal error on %s %s", request.method, name)
                    resp = error_response(500, f"internal emulator error on {name}; see the server log")
            if fault is not None and fault.json_set and isinstance(resp, web.Response) and resp.body:
                body = set_json(json.loads(bytes(resp.body)), fault.json_set)  # type: ignore[arg-type]
                resp = web.json_response(body, status=resp.status)
            if fault is not None and fault.drop and isinstance(resp, web.Response) and resp.body:
                return await _drop_mid_body(request, resp)
            if fault is not None and fault.trickle_s and isinstance(resp, web.Response) and resp.body:
                return await _trickle(request, _count(emu, st, resp), fault.trickle_s)
            return _count(emu, st, resp)
        finally:
            if name != "control":
                emu.requests.record(name, started, conn=_connection(request), seq_in=seq_in,
                                    uses=_uses(request, name), hands=_hands(answer, name))
            if log.isEnabledFor(logging.DEBUG):
                ms = (time.perf_counter() - t0) * 1e3
                log.debug(
                    "%s %s (%d bytes in) %.1f ms", request.method, name, request.content_length or 0, ms
                )

    return middleware


def _connection(request: web.Request) -> str:
    """The connection a request came on (its client port and transport: unique while it is open)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[1] if isinstance(peer, tuple) else '?'}-{id(transport):x}"


_SIGNATURE = re.compile(r"[?&]s=([^&\"\\\s]+)")


def _uses(request: web.Request, route: str) -> tuple[str, ...]:
    """Digests of the credentials a request carries that an answer handed out (request_log)."""
    out = []
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        out.append(digest(auth[7:]))
    if route == "fetch" and request.query.get("s"):
        out.append(digest(request.query["s"]))
    return tuple(out)


def _hands(answer: web.StreamResponse | None, route: str) -> tuple[str, ...]:
    """Digests of the credentials an answer hands out: a Xet token, the fetch URLs' signatures."""
    if route not in ("xet_token", "reconstruction") or not isinstance(answer, web.Response):
        return ()
    if not answer.body:
        return ()
    text = bytes(answer.body).decode("utf-8", "replace")  # type: ignore[arg-type]
    if route == "xet_token":
        m = re.search(r'"accessToken":\s*"([^"]+)"', text)
        return (digest(m.group(1)),) if m else ()
    return tuple({digest(s) for s in _SIGNATURE.findall(text)})


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


async def _trickle(request: web.Request, resp: web.Response, per_byte_s: float) -> web.StreamResponse:
    """Send the headers at once, then the body one byte every ``per_byte_s`` seconds: a server
    that answers, slowly (each read of the client gets a byte in time; only a bound on the
    request's total time stops it). A client that gives up ends it."""
    body = bytes(resp.body)  # type: ignore[arg-type]
    stream = web.StreamResponse(status=resp.status, headers=resp.headers)
    stream.content_length = len(body)
    try:
        await stream.prepare(request)
        for i in range(len(body)):
            await asyncio.sleep(per_byte_s)
            await stream.write(body[i : i + 1])
        await stream.write_eof()
    except (ConnectionError, RuntimeError):  # the client hung up (as it should, at its deadline)
        if request.transport is not None:
            request.transport.abort()
    return stream


# --------------------------------------------------------------------------------------------
# control routes
# --------------------------------------------------------------------------------------------
class ControlRoutes:
    def __init__(self, emu: Emulator) -> None:
        self.emu = emu

    def _admin(self, request: web.Request, what: str) -> None:
        sent = request.headers.get("X-Emulator-Admin", "")
        key = self.emu.admin_key  # no key configured: nobody may (never "everybody may")
        if not key or not hmac.compare_digest(sent.encode(), key.encode()):
            raise HubError(403, f"{what} needs the emulator's admin key (X-Emulator-Admin)")

    async def stats(self, request: web.Request) -> web.StreamResponse:
        if not self.emu.auth.open:  # with users configured, what they do is not for anyone to read
            self._admin(request, "the stats route")
        return web.json_response(self.emu.snapshot())

    async def requests(self, request: web.Request) -> web.StreamResponse:
        self._admin(request, "the request log")
        entries = self.emu.requests.entries()
        if request.method == "DELETE":
            self.emu.requests.clear()
        return web.json_response(entries)

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def gc(self, request: web.Request) -> web.StreamResponse:
        """Collect unreferenced xorbs now; ``?grace=SECONDS`` overrides the configured grace."""
        self._admin(request, "xorb collection")
        raw = request.query.get("grace")
        try:
            grace = None if raw is None else float(raw)
        except ValueError:
            grace = -1.0
        if grace is not None and not grace >= 0:
            raise HubError(400, f"grace must be a number of seconds >= 0, got {raw!r}")
        done = await self.emu.collect_xorbs(grace)
        used = self.emu.collector.grace_s if grace is None else grace
        return web.json_response({**done.to_json(), "grace_s": used})

    async def faults(self, request: web.Request) -> web.StreamResponse:
        self._admin(request, "fault control")
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


# what a client asks of model/dataset/space repos: /api/{models,datasets,spaces}/..., and
# downloads /[{datasets,spaces}/]{ns}/{repo}/resolve/...
_REPO_ROUTE = re.compile(r"^/(api/(models|datasets|spaces)/.+|((datasets|spaces)/)?[^/]+/[^/]+/resolve/.*)$")


async def not_found(request: web.Request) -> web.StreamResponse:
    log.info("no route for %s %s", request.method, request.path)
    if _REPO_ROUTE.match(request.path):
        return await request.app[HUB].repo_not_found(request)
    raise HubError(404, f"no route {request.method} {request.path} in the emulator")


def build_app(emu: Emulator) -> web.Application:
    app = web.Application(middlewares=[make_middleware(emu)], client_max_size=_MAX_XORB + 1024 * 1024)
    app[BODY_TIMEOUT] = emu.body_timeout_s
    cas = CasRoutes(emu)
    hub, ctl = HubRoutes(emu, cas.stream_range), ControlRoutes(emu)
    app[HUB] = hub
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
    r.add_route("*", "/_emulator/requests", ctl.requests)
    r.add_route("*", "/_emulator/faults", ctl.faults)
    r.add_post("/_emulator/gc", ctl.gc)
    r.add_route("*", "/{tail:.*}", not_found)
    return app


async def _empty_ok(request: web.Request) -> web.StreamResponse:
    await read_body(request, MAX_SMALL_BODY)
    return web.json_response({})


__all__ = ["Emulator", "HubError", "build_app"]
