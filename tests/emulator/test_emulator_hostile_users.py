"""The emulator holds against its own users (issue 24, items 7, 8, 9 and 13).

Each test is an attack, or a failure, that a token holder (or anyone, on public buckets) could
cause, driven by the unmodified clients or by raw HTTP where the attack needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import socket
import sqlite3
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2
import pytest

from kvbucket.testing import HubEmulator
from kvbucket.testing.fleet_node import until
from kvbucket.testing.hub_emulator.state import State
from kvbucket.testing.hub_fixtures import MEMBER_USER, ORG, OTHER_USER, HubBucket, RunningHub

MiB = 1024 * 1024


def _new_bucket(hub: RunningHub, ns: str, token: str, *, private: bool = True) -> str:
    bucket_id = f"{ns}/h-{uuid.uuid4().hex[:12]}"
    hub.api(token).create_bucket(bucket_id, private=private)
    return bucket_id


def _add_by_hash(hub: RunningHub, token: str, bucket_id: str, path: str, xet_hash: str) -> tuple[int, Any]:
    """A raw ``addFile`` line naming a hash, as any client may send it."""
    line = json.dumps({"type": "addFile", "path": path, "xetHash": xet_hash, "mtime": 1})
    r = httpx2.post(
        f"{hub.endpoint}/api/buckets/{bucket_id}/batch", content=line.encode() + b"\n",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
    )  # fmt: skip
    return r.status_code, r.json()


def _resolve(hub: RunningHub, token: str, bucket_id: str, path: str) -> tuple[int, bytes]:
    url = f"{hub.endpoint}/buckets/{bucket_id}/resolve/{path}"
    r = httpx2.get(url, headers={"Authorization": f"Bearer {token}"})
    return r.status_code, r.content


def _hash_of(hub: RunningHub, token: str, bucket_id: str, path: str) -> str:
    (info,) = hub.api(token).get_bucket_paths_info(bucket_id, [path])
    return str(info.xet_hash)


# -- item 7: an addFile by hash is for content the caller uploaded or can already read ---------------
def test_add_by_hash_of_another_users_private_file_is_refused(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    secret = b"alice's private notes " * 1000
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(secret, "notes.txt")])
    alice_hash = _hash_of(hub, hub.write_token, hub_bucket.bucket_id, "notes.txt")
    bob = hub.token(OTHER_USER)
    bobs = _new_bucket(hub, OTHER_USER, bob)

    status, body = _add_by_hash(hub, bob, bobs, "stolen.txt", alice_hash)
    assert status == 422  # every line failed
    assert body["failed"] == [{"path": "stolen.txt", "error": body["failed"][0]["error"]}]
    assert "unknown xetHash" in body["failed"][0]["error"]  # the same answer as for a hash nobody stored
    assert _resolve(hub, bob, bobs, "stolen.txt")[0] == 404
    assert list(hub.api(bob).list_bucket_tree(bobs)) == []
    # copyFile from her bucket is refused too (it was already)
    copy = json.dumps({"type": "copyFile", "path": "c.txt", "xetHash": alice_hash, "mtime": 1,
                       "sourceRepoType": "bucket", "sourceRepoId": hub_bucket.bucket_id})  # fmt: skip
    r = httpx2.post(f"{hub.endpoint}/api/buckets/{bobs}/batch", content=copy.encode(),
                    headers={"Authorization": f"Bearer {bob}"})  # fmt: skip
    assert r.status_code == 422
    # alice still reads her file
    assert _resolve(hub, hub.write_token, hub_bucket.bucket_id, "notes.txt") == (200, secret)


def test_add_by_hash_works_for_what_the_caller_uploaded_or_can_read(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    data = b"the same bytes, uploaded by two users " * 500
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(data, "a.txt")])
    h = _hash_of(hub, hub.write_token, hub_bucket.bucket_id, "a.txt")
    bob = hub.token(OTHER_USER)
    bobs = _new_bucket(hub, OTHER_USER, bob)
    # bob uploads the same bytes himself (hf_xet dedups its chunks against what it uploaded for
    # alice, but the shard it sends names the file): his upload, his to add, again by hash
    hub.api(bob).batch_bucket_files(bobs, add=[(data, "mine.txt")])
    assert _hash_of(hub, bob, bobs, "mine.txt") == h
    assert _add_by_hash(hub, bob, bobs, "again.txt", h)[0] == 200
    assert _resolve(hub, bob, bobs, "again.txt") == (200, data)

    # content one can read: a private bucket of one's organisation, and any public bucket
    member = hub.token(MEMBER_USER)
    org_bucket = _new_bucket(hub, ORG, hub.write_token)
    shared = b"shared inside the organisation " * 300
    hub.api().batch_bucket_files(org_bucket, add=[(shared, "s.txt")])
    mine = _new_bucket(hub, MEMBER_USER, member)
    assert _add_by_hash(hub, member, mine, "s.txt", _hash_of(hub, member, org_bucket, "s.txt"))[0] == 200
    assert _resolve(hub, member, mine, "s.txt") == (200, shared)
    public = _new_bucket(hub, hub.namespace, hub.write_token, private=False)
    open_data = b"public bytes " * 300
    hub.api().batch_bucket_files(public, add=[(open_data, "p.txt")])
    assert _add_by_hash(hub, bob, bobs, "p.txt", _hash_of(hub, bob, public, "p.txt"))[0] == 200
    assert _resolve(hub, bob, bobs, "p.txt") == (200, open_data)


# -- raw HTTP: what an attacker sends ------------------------------------------------------------
def _connect(endpoint: str) -> socket.socket:
    u = urlsplit(endpoint)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def _head(endpoint: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {urlsplit(endpoint).netloc}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    """The status of the reply on ``sock`` (0 if the server closed without one)."""
    sock.settimeout(30)
    data = b""
    try:
        while b"\r\n" not in data:
            got = sock.recv(4096)
            if not got:
                break
            data += got
    except ConnectionError:
        pass
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _stall(endpoint: str, path: str, headers: dict[str, str], announced: int, sent: int) -> socket.socket:
    """A request that announces ``announced`` body bytes, sends ``sent`` of them, then nothing."""
    sock = _connect(endpoint)
    sock.sendall(_head(endpoint, path, {**headers, "Content-Length": str(announced)}))
    sock.sendall(os.urandom(sent))
    return sock


def _chunked(endpoint: str, path: str, headers: dict[str, str], body: bytes, total: int) -> tuple[int, int]:
    """Send a ``Transfer-Encoding: chunked`` body of ``total`` bytes (``body``, then padding to
    ``total``, then ``tail``), 1 MiB a chunk, stopping as soon as a reply arrives.

    Returns (status, bytes sent before the reply came).
    """
    sock = _connect(endpoint)
    sent = 0
    try:
        sock.sendall(_head(endpoint, path, {**headers, "Transfer-Encoding": "chunked"}))
        while sent < total and not _answered(sock):
            piece = body[sent : sent + MiB] if sent < len(body) else b"a" * min(MiB, total - sent)
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
        if not _answered(sock):
            sock.sendall(b"0\r\n\r\n")
    except ConnectionError:  # the server answered and closed: read what it said
        pass
    try:
        return _status(sock), sent
    finally:
        sock.close()


def _xet_write_token(hub: RunningHub, token: str, bucket_id: str) -> str:
    r = httpx2.get(
        f"{hub.endpoint}/api/buckets/{bucket_id}/xet-write-token",
        headers={"Authorization": f"Bearer {token}"},
    )
    r.raise_for_status()
    return str(r.json()["accessToken"])


def _tmp_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "xorbs").rglob(".tmp-*"))


# -- item 8: stalled bodies never hold the workers that other users need ---------------------------
def _store_and_read(api: Any, bucket_id: str) -> float:
    """One user's store (a random 4 MiB object through huggingface_hub + hf_xet), then its
    paths-info and a ``resolve`` read of it (what waited 60 s behind two stalls before)."""
    data = os.urandom(4 * MiB)
    t0 = time.perf_counter()
    name = f"o-{uuid.uuid4().hex[:8]}"
    api.batch_bucket_files(bucket_id, add=[(data, name)])
    (info,) = api.get_bucket_paths_info(bucket_id, [name])
    assert info.size == len(data)
    url = f"{api.endpoint}/buckets/{bucket_id}/resolve/{name}"
    r = httpx2.get(url, headers={"Authorization": f"Bearer {api.token}", "Range": "bytes=1000-1999"})
    assert r.status_code == 206 and r.content == data[1000:2000]
    return time.perf_counter() - t0


def test_stalled_xorb_uploads_do_not_delay_another_users_store(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    attacker = hub.token(OTHER_USER)
    theirs = _new_bucket(hub, OTHER_USER, attacker)
    xet = _xet_write_token(hub, attacker, theirs)
    victim = hub_bucket.api
    _store_and_read(victim, hub_bucket.bucket_id)  # warm up: the client's session and connections
    alone = statistics.median(_store_and_read(victim, hub_bucket.bucket_id) for _ in range(3))
    # four stalls, as many as the emulator has workers at most: large Content-Length, part of
    # the body (past the zero-copy threshold), then nothing
    stalls = [
        _stall(hub.endpoint, f"/cas/v1/xorbs/default/{os.urandom(32).hex()}",
               {"Authorization": f"Bearer {xet}"}, 60 * MiB, 2 * MiB)
        for _ in range(4)
    ]  # fmt: skip
    try:
        time.sleep(0.5)  # let the server take them up
        stalled = statistics.median(_store_and_read(victim, hub_bucket.bucket_id) for _ in range(3))
        assert stalled - alone < 1.0, f"store: {alone:.2f} s alone, {stalled:.2f} s beside four stalls"
        assert not any(_answered(s) for s in stalls)  # the stalls were open all along
    finally:
        for s in stalls:
            s.close()
    assert until(lambda: not _tmp_files(hub.data_dir), 10)  # a cut-off body leaves no file


def test_stalled_and_trickling_bodies_time_out(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "d", tokens={"eve": ("eve-secret-1", "write")}, body_timeout_s=1.0) as emu:
        auth = {"Authorization": "Bearer eve-secret-1"}
        httpx2.post(f"{emu.endpoint}/api/buckets/eve/b", json={}, headers=auth).raise_for_status()
        r = httpx2.get(f"{emu.endpoint}/api/buckets/eve/b/xet-write-token", headers=auth)
        xet = {"Authorization": f"Bearer {r.json()['accessToken']}"}
        xorb = f"/cas/v1/xorbs/default/{os.urandom(32).hex()}"
        socks = [
            _stall(emu.endpoint, xorb, xet, 8 * MiB, 2 * MiB),  # the zero-copy path
            _stall(emu.endpoint, xorb, xet, 512 * 1024, 1000),  # a small xorb: the buffered path
            _stall(emu.endpoint, "/api/buckets/eve/b/paths-info", auth, 1000, 10),  # a JSON route
            _stall(emu.endpoint, "/cas/v1/shards", xet, 1000, 10),
        ]
        assert [_status(s) for s in socks] == [408, 408, 408, 408]
        for s in socks:
            s.close()
        # a trickle: a byte every 50 ms never goes a second without one, but falls behind the
        # minimum rate (what it announced would otherwise buy it 30 s at that rate)
        sock = _stall(emu.endpoint, xorb, xet, 8 * MiB, 1000)  # the zero-copy path (announced >= 1 MiB)
        while not _answered(sock):
            with contextlib.suppress(ConnectionError):
                sock.send(b"x")
            time.sleep(0.05)
        assert _status(sock) == 408
        sock.close()
        # a chunked body that stops sending
        sock = _connect(emu.endpoint)
        sock.sendall(
            _head(emu.endpoint, "/api/buckets/eve/b/batch", {**auth, "Transfer-Encoding": "chunked"})
        )
        sock.sendall(b"5\r\nhello\r\n")
        assert _status(sock) == 408
        sock.close()
        assert _tmp_files(emu.data_dir) == []
        assert emu.stats()["statuses"]["408"] == 6


# -- item 9: request bodies are bounded whatever the transfer encoding ----------------------------
def test_chunked_bodies_over_the_limits_get_a_quick_413(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    public = _new_bucket(hub, hub.namespace, hub.write_token, private=False)
    auth = {"Authorization": f"Bearer {hub.write_token}"}
    xet = {"Authorization": f"Bearer {_xet_write_token(hub, hub.write_token, hub_bucket.bucket_id)}"}
    paths = b'{"paths": ["a"], "pad": "'  # valid JSON once the padding is closed: a 40 MiB request
    cases = [  # (route, headers, total bytes, limit)
        (f"/api/buckets/{public}/paths-info", {}, 40 * MiB, 16 * MiB),  # anonymous, public bucket
        (f"/api/buckets/{hub_bucket.bucket_id}/batch", auth, 40 * MiB, 16 * MiB),
        ("/v1/telemetry", {}, 40 * MiB, 1 * MiB),  # anonymous
        (f"/cas/v1/xorbs/default/{os.urandom(32).hex()}", xet, 100 * MiB, 65 * MiB),
        ("/cas/v2/shards", xet, 100 * MiB, 64 * MiB),
    ]
    for route, headers, total, limit in cases:
        status, sent = _chunked(hub.endpoint, route, headers, paths, total)
        assert status == 413, route
        assert sent < limit + 16 * MiB, f"{route}: {sent} bytes went in before the 413"


def test_concurrent_oversized_chunked_bodies_keep_the_server_small(tmp_path: Path) -> None:
    """The attack of issue 24: four concurrent 60 MiB chunked bodies, anonymous, on a public bucket."""
    with HubEmulator(tmp_path / "d", subprocess=True) as emu:  # its own process: its own memory
        httpx2.post(f"{emu.endpoint}/api/buckets/local/pub", json={}).raise_for_status()
        before = _rss_kib(emu.pid, "VmRSS")
        results: list[tuple[int, int]] = []
        threads = [
            threading.Thread(target=lambda: results.append(
                _chunked(emu.endpoint, "/api/buckets/local/pub/paths-info", {}, b'{"pad": "', 60 * MiB)))
            for _ in range(4)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [413] * 4
        grew_mib = (_rss_kib(emu.pid, "VmHWM") - before) / 1024
        assert grew_mib < 128, f"the server grew by {grew_mib:.0f} MiB"


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    pytest.skip("no /proc: cannot read the server's memory")


# -- item 13: a full disk answers at once, with a status hf_xet does not retry ---------------------
@pytest.fixture
def full_disk(hub_emulator: RunningHub, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """``full_disk(True)`` makes every write into the emulator's xorb store fail with ENOSPC, as
    on a full disk: ``posix_fallocate``, ``write`` and ``splice`` (the three calls that put xorb
    bytes on disk). The clients are native code, untouched by the patch."""
    xorbs = str(hub_emulator.data_dir / "xorbs")
    on = [False]
    real = {name: getattr(os, name) for name in ("posix_fallocate", "write", "splice")}

    def into_xorbs(fd: int) -> bool:
        with contextlib.suppress(OSError):
            return os.readlink(f"/proc/self/fd/{fd}").startswith(xorbs)
        return False

    def failing(name: str, fd_arg: int) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if on[0] and into_xorbs(args[fd_arg]):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real[name](*args, **kwargs)

        return call

    monkeypatch.setattr(os, "posix_fallocate", failing("posix_fallocate", 0))
    monkeypatch.setattr(os, "write", failing("write", 0))
    monkeypatch.setattr(os, "splice", failing("splice", 1))  # splice(src, dst, ...): the destination
    yield lambda full: on.__setitem__(0, full)
    on[0] = False


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="needs /proc to aim the ENOSPC at the xorb store"
)
def test_full_disk_fails_the_upload_at_once_and_keeps_what_is_stored(
    hub_bucket: HubBucket, full_disk: Callable[[bool], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub, api, bucket = hub_bucket.hub, hub_bucket.api, hub_bucket.bucket_id
    kept = os.urandom(3 * MiB)
    api.batch_bucket_files(bucket, add=[(kept, "kept.bin")])

    def xorb_uploads() -> int:
        return int(hub.stats()["routes"].get("xorb_upload", {}).get("requests", 0))

    full_disk(True)
    for size in (4 * MiB, 300_000):  # the zero-copy path (>= 1 MiB) and the buffered one
        before = xorb_uploads()
        with pytest.raises(Exception, match="413") as e:
            api.batch_bucket_files(bucket, add=[(os.urandom(size), f"new-{size}.bin")])
        assert xorb_uploads() - before == 1, f"{e.value}: the client retried"
    full_disk(False)

    def index_full(*args: Any) -> None:  # SQLite's own answer when the disk fills under it
        raise sqlite3.OperationalError("database or disk is full")

    def shard_uploads() -> int:
        return int(hub.stats()["routes"].get("shard_upload", {}).get("requests", 0))

    before = shard_uploads()
    with monkeypatch.context() as m:
        m.setattr(State, "put_reconstructions", index_full)
        with pytest.raises(Exception, match="413"):
            api.batch_bucket_files(bucket, add=[(os.urandom(200_000), "indexed.bin")])
    assert shard_uploads() - before == 1

    assert _tmp_files(hub.data_dir) == []
    assert [f.path for f in api.list_bucket_tree(bucket)] == ["kept.bin"]
    api.download_bucket_files(bucket, [("kept.bin", tmp_path / "kept.bin")])
    assert (tmp_path / "kept.bin").read_bytes() == kept
    again = os.urandom(4 * MiB)  # space again: the same kind of upload goes through
    api.batch_bucket_files(bucket, add=[(again, "again.bin")])
    assert _resolve(hub, hub.write_token, bucket, "again.bin") == (200, again)


def test_a_cancelled_zero_copy_upload_closes_its_files_only_after_its_worker(tmp_path: Path) -> None:
    """A request cancelled (server shutdown) while a worker splices its body: the descriptors the
    worker uses are closed when it is done, never under it (a reused number would take its bytes)."""
    from kvbucket.testing.hub_emulator.zerocopy import splice_to_file

    pool = ThreadPoolExecutor(1)
    calls: list[str] = []
    started, release = threading.Event(), threading.Event()

    async def held_run(fn: Callable[..., Any], *args: Any) -> Any:
        def call() -> Any:
            started.set()
            release.wait(30)  # the worker is mid-slice when the request is cancelled
            calls.append(fn.__name__)
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def open_here() -> int:
        """Descriptors of this process open on a file under tmp_path: the upload's temp file.
        Counted by target, not in total: other tests' threads in this worker process open and
        close descriptors meanwhile (a total once stayed level while the temp file was held)."""
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed since listed
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
        return n

    async def main() -> None:
        a, b = socket.socketpair()
        b.sendall(b"x" * 1000)
        assert open_here() == 0
        task = asyncio.ensure_future(splice_to_file(a.fileno(), b"", 2 * MiB, tmp_path, held_run, 5.0))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert open_here() == 1  # still open: the worker is using it
        release.set()
        for _ in range(3000):
            if open_here() == 0:
                break
            await asyncio.sleep(0.01)
        assert calls == ["start"]
        assert open_here() == 0  # closed once it finished
        a.close()
        b.close()

    try:
        asyncio.run(main())
    finally:
        release.set()
        pool.shutdown()
    assert list(tmp_path.iterdir()) == []
