"""The Xet CAS routes: xorb and shard uploads, reconstructions, signed ranged fetches."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from . import state, zerocopy
from .core import Emulator
from .faults import Fault
from .state import is_disk_full
from .wire import (
    _READ_WINDOW,
    FAULT,
    FETCH_URL_TTL_S,
    MAX_SHARD_BYTES,
    ZERO_COPY_MIN,
    HubError,
    _pread,
    disk_full,
    error_response,
    origin,
    parse_range,
    read_body,
    too_large,
)  # fmt: skip
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
            raise too_large(_MAX_XORB)
        sock_fd = zerocopy.socket_fd(request) if self.emu.zero_copy and (n or 0) >= ZERO_COPY_MIN else None
        if sock_fd is not None:
            return await self._upload_xorb_spliced(request, xorb_hex, sock_fd)
        data = await read_body(request, _MAX_XORB)
        if self.state.xorb_known(xorb_hex):  # deduped against: used now
            return web.json_response({"was_inserted": False})
        try:
            idx = await self.emu.cpu(verify_xorb, data, xorb_hex)
        except XetFormatError as e:
            log.warning("refused xorb %s: %s", xorb_hex, e)
            raise HubError(400, f"xorb refused: {e}", "InvalidXorb") from None
        inserted = await self.emu.disk(self.state.put_xorb, idx, data)
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
            tmp = await zerocopy.splice_to_file(
                sock_fd, head, n, self.state.xorb_dir, self.emu.cpu, self.emu.body_timeout_s
            )
            if self.state.xorb_known(xorb_hex):  # deduped against: used now
                resp: web.StreamResponse = web.json_response({"was_inserted": False})
            else:
                # Verified (CPU) while it is fsynced (disk), not one after the other; stored and
                # acknowledged only once both are done.
                verified, synced = await asyncio.gather(
                    self.emu.cpu(verify_xorb_file, tmp, xorb_hex),
                    self.emu.disk(state.fsync_file, tmp),
                    return_exceptions=True,
                )
                for outcome in (verified, synced):
                    if isinstance(outcome, BaseException):
                        raise outcome
                inserted = await self.emu.disk(self.state.put_xorb_file, verified, tmp, True)
                resp = web.json_response({"was_inserted": inserted})
        except XetFormatError as e:
            log.warning("refused xorb %s: %s", xorb_hex, e)
            resp = error_response(400, f"xorb refused: {e}", "InvalidXorb")
        except TimeoutError as e:
            log.warning("xorb %s: body not received: %s", xorb_hex, e)
            resp = error_response(408, f"the xorb body was not received in time: {e}")
        except Exception as e:
            if is_disk_full(e):
                log.error("xorb %s refused: disk full: %s", xorb_hex, e)
                err = disk_full(f"xorb {xorb_hex}")
                resp = error_response(err.status, err.message, err.code)
            elif isinstance(e, (OSError, ConnectionError)):
                log.warning("xorb %s: body not received: %s", xorb_hex, e)
                resp = error_response(400, f"the xorb body was not received in full: {e}")
            else:
                log.exception("internal error receiving xorb %s", xorb_hex)
                resp = error_response(500, "internal emulator error on xorb_upload; see the server log")
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # already renamed when stored
        return zerocopy.finish(request, resp)

    def _accept_shard(self, data: bytes, bucket_id: str) -> list[FileRecord]:
        """Verify and store a shard while no collection can drop its xorbs (``xorb_gc``), and
        mark them used, so the grace period protects them until ``addFile`` commits its files."""
        with self.state.xorb_guard.shared():
            files, xorbs = self._verify_shard(data)
            self.state.put_reconstructions(files, bucket_id)
            for x in xorbs:
                self.state.touch_xorb(x)
        return files

    def _verify_shard(self, data: bytes) -> tuple[list[FileRecord], set[str]]:
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
        used = {x.hash_hex for x in shard.xorbs} | {s.xorb_hex for f in shard.files for s in f.segments}
        return shard.files, used

    async def upload_shard(self, request: web.Request) -> web.StreamResponse:
        bucket_id, _ = self.token(request, write=True)
        data = bytes(await read_body(request, MAX_SHARD_BYTES))
        try:
            files = await self.emu.cpu(self._accept_shard, data, bucket_id)
        except XetFormatError as e:
            log.warning("refused shard: %s", e)
            raise HubError(400, f"shard refused: {e}", "InvalidShard") from None
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
            # what this bucket holds or was uploaded through it: exactly what its token may
            # ``addFile`` by hash (and so read back by adding it): a hash a delete removed since included
            file_hex != EMPTY_FILE_HASH_HEX and bucket_id not in self.state.buckets_reaching(file_hex)
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
        if fault is None or not (fault.drop or fault.trickle_s or fault.flip):  # applied to a whole body
            return await self._sendfile(request, str(path), start, end, size, rng is not None)
        data = await self.emu.cpu(_pread, str(path), start, end - start)
        if fault.flip and data:  # damage on the wire: the stored xorb stays intact
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x01
            data = bytes(flipped)
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
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("the client went away")
            sent = _sendfile_now(transport, f.fileno(), start, end - start)
            try:
                if sent < end - start:
                    await asyncio.get_running_loop().sendfile(transport, f, start + sent, end - start - sent)
            except NotImplementedError:
                f.seek(start + sent)
                await resp.write(f.read(end - start - sent))
        await resp.write_eof()
        self.emu.stats["fetch"].bytes_out += end - start
        return resp

    async def stream_range(self, rec: FileRecord, start: int, end: int) -> AsyncIterator[bytes]:
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


def _sendfile_now(transport: asyncio.BaseTransport, file_fd: int, offset: int, count: int) -> int:
    """Send what the socket takes right now with one ``os.sendfile``; the caller sends the rest.

    Why: ``loop.sendfile`` costs several event-loop rounds of Python (flush waiter, futures,
    writer callbacks) even when, as usual on loopback, the kernel takes a whole 2 MiB range in
    one call; that Python was most of a fetch's CPU. Only when the transport has nothing buffered
    (the headers went out), so bytes cannot be reordered; never for TLS.
    """
    sock = transport.get_extra_info("socket")
    if (
        sock is None
        or transport.get_extra_info("sslcontext") is not None
        or not isinstance(transport, asyncio.WriteTransport)
        or transport.get_write_buffer_size()
    ):
        return 0
    try:
        return os.sendfile(sock.fileno(), file_fd, offset, count)
    except (BlockingIOError, InterruptedError):
        return 0
