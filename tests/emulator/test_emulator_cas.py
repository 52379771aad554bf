"""The Xet CAS side spoken by hand: poisoning defences, shard checks, reconstruction ranges, caps.

Xorbs and shards are built here byte by byte from the published format, then fed to the server;
a hand-built file that the server accepts must also download correctly through the real client.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import struct
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import lz4.frame
import pytest

from kvbucket.testing.hub_emulator.xet import (
    BOOKEND_HASH,
    SHARD_HEADER_TAG,
    chunk_hash,
    file_hash,
    hash_to_hex,
    hex_to_hash,
    range_verification_hash,
    xorb_hash,
)
from kvbucket.testing.hub_fixtures import HubBucket


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def xet_token(bucket: HubBucket, scope: str = "write", token: str | None = None) -> tuple[str, str]:
    hub = bucket.hub
    status, _, body = http(
        "GET",
        f"{hub.endpoint}/api/buckets/{bucket.bucket_id}/xet-{scope}-token",
        headers={"Authorization": f"Bearer {token or hub.write_token}"},
    )
    assert status == 200, body
    d = json.loads(body)
    return d["casUrl"], d["accessToken"]


def chunk_bytes(data: bytes, scheme: int) -> bytes:
    payload = lz4.frame.compress(data) if scheme == 1 else data
    return (
        bytes([0])
        + len(payload).to_bytes(3, "little")
        + bytes([scheme])
        + len(data).to_bytes(3, "little")
        + payload
    )


def build_xorb(chunks: list[bytes]) -> tuple[str, bytes]:
    body = chunk_bytes(chunks[0], 0) + b"".join(chunk_bytes(c, 1) for c in chunks[1:])
    return hash_to_hex(xorb_hash([(chunk_hash(c), len(c)) for c in chunks])), body


def build_shard(
    files: list[tuple[str, list[tuple[str, int, int, int]], list[bytes] | None]],
    xorbs: list[tuple[str, list[bytes]]],
) -> bytes:
    """files: (file hash, [(xorb, unpacked, chunk_start, chunk_end)], verification hashes or None)."""
    out = bytearray(SHARD_HEADER_TAG + struct.pack("<QQ", 2, 0))
    for fh, segs, verif in files:
        flags = (1 << 31) if verif is not None else 0
        out += hex_to_hash(fh) + struct.pack("<IIQ", flags, len(segs), 0)
        for xh, ub, cs, ce in segs:
            out += hex_to_hash(xh) + struct.pack("<IIII", 0, ub, cs, ce)
        for v in verif or []:
            out += v + bytes(16)
    out += BOOKEND_HASH + bytes(16)
    for xh, chunks in xorbs:
        total = sum(len(c) for c in chunks)
        out += hex_to_hash(xh) + struct.pack("<IIII", 0, len(chunks), total, total)
        off = 0
        for c in chunks:
            out += chunk_hash(c) + struct.pack("<IIII", off, len(c), 0, 0)
            off += len(c)
    out += BOOKEND_HASH + bytes(16)
    return bytes(out)


CHUNKS = [bytes(range(256)) * 40, b"second chunk " * 900, b"third" * 2000]


def upload_xorb(cas: str, tok: str, xh: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    return http("POST", f"{cas}/v1/xorbs/default/{xh}", body, {"Authorization": f"Bearer {tok}"})


def post_shard(cas: str, tok: str, shard: bytes, version: int = 2) -> tuple[int, dict[str, str], bytes]:
    return http("POST", f"{cas}/v{version}/shards", shard, {"Authorization": f"Bearer {tok}"})


def the_file() -> tuple[str, list[tuple[str, int, int, int]], list[bytes]]:
    xh, _ = build_xorb(CHUNKS)
    fh = hash_to_hex(file_hash([(chunk_hash(c), len(c)) for c in CHUNKS]))
    segs = [(xh, sum(map(len, CHUNKS)), 0, 3)]
    return fh, segs, [range_verification_hash([chunk_hash(c) for c in CHUNKS])]


def test_poisoned_xorb_is_refused(hub_bucket: HubBucket) -> None:
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(CHUNKS)
    other, _ = build_xorb(CHUNKS[:2])
    status, headers, msg = upload_xorb(cas, tok, other, body)  # content of one xorb under another's name
    assert status == 400 and headers.get("X-Error-Code") == "InvalidXorb"
    assert b"hashes to" in msg
    tampered = bytearray(body)
    tampered[20] ^= 0xFF  # one flipped byte in the first (uncompressed) chunk
    assert upload_xorb(cas, tok, xh, bytes(tampered))[0] == 400
    assert upload_xorb(cas, tok, xh, body[:-3])[0] == 400  # truncated
    assert upload_xorb(cas, tok, xh, b"XETBLOB" + bytes(100))[0] == 400  # not chunks at all
    status, _, ok = upload_xorb(cas, tok, xh, body)
    assert status == 200 and json.loads(ok) == {"was_inserted": True}
    assert json.loads(upload_xorb(cas, tok, xh, body)[2]) == {"was_inserted": False}


def test_shards_naming_unknown_xorbs_or_bad_ranges_are_refused(hub_bucket: HubBucket) -> None:
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(CHUNKS)
    fh, segs, _verif = the_file()
    unknown = "12" * 32
    for version in (1, 2):
        bad = build_shard([(fh, [(unknown, segs[0][1], 0, 3)], None)], [])
        status, _, msg = post_shard(cas, tok, bad, version)
        assert status == 400 and b"unknown xorb" in msg
    assert post_shard(cas, tok, build_shard([], [(unknown, CHUNKS)]))[0] == 400
    assert upload_xorb(cas, tok, xh, body)[0] == 200
    size = segs[0][1]
    cases = {
        "out of range": build_shard([(fh, [(xh, size, 0, 4)], None)], []),
        "empty range": build_shard([(fh, [(xh, 0, 2, 2)], None)], []),
        "wrong size": build_shard([(fh, [(xh, size + 1, 0, 3)], None)], []),
        "wrong file hash": build_shard([("34" * 32, segs, None)], []),
        "wrong verification": build_shard([(fh, segs, [bytes(32)])], []),
        "xorb chunk list differs": build_shard([], [(xh, CHUNKS[:2])]),
        "bad tag": b"\x00" * 32 + build_shard([(fh, segs, None)], [])[32:],
        "truncated": build_shard([(fh, segs, None)], [])[:100],
    }
    for why, shard in cases.items():
        assert post_shard(cas, tok, shard)[0] == 400, why
    # nothing refused above reached the index: the file hash is still unknown to the Hub side
    status, _, _ = http(
        "POST",
        f"{hub_bucket.hub.endpoint}/api/buckets/{hub_bucket.bucket_id}/batch",
        json.dumps({"type": "addFile", "path": "x", "xetHash": fh, "mtime": 1}).encode() + b"\n",
        {"Authorization": f"Bearer {hub_bucket.hub.write_token}", "Content-Type": "application/x-ndjson"},
    )
    assert status == 422


def test_hand_built_file_downloads_through_the_real_client(hub_bucket: HubBucket, tmp_path: Path) -> None:
    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(CHUNKS)
    fh, segs, verif = the_file()
    assert upload_xorb(cas, tok, xh, body)[0] == 200
    status, headers, frames = post_shard(cas, tok, build_shard([(fh, segs, verif)], [(xh, CHUNKS)]))
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    assert json.loads(frames.splitlines()[-1]) == {"type": "result"}
    assert json.loads(post_shard(cas, tok, build_shard([(fh, segs, None)], []), version=1)[2]) == {
        "result": 1
    }
    line = {"type": "addFile", "path": "hand/made.bin", "xetHash": fh, "mtime": 1_700_000_000_000}
    status, _, res = http(
        "POST",
        f"{hub.endpoint}/api/buckets/{bid}/batch",
        json.dumps(line).encode() + b"\n",
        {"Authorization": f"Bearer {hub.write_token}", "Content-Type": "application/x-ndjson"},
    )
    assert status == 200 and json.loads(res)["failed"] == []
    hub_bucket.api.download_bucket_files(bid, [("hand/made.bin", tmp_path / "m")])
    assert (tmp_path / "m").read_bytes() == b"".join(CHUNKS)


def _reconstruct(hub_bucket: HubBucket, fh: str, rng: str | None, version: int) -> tuple[int, Any]:
    cas, tok = xet_token(hub_bucket, "read")
    headers = {"Authorization": f"Bearer {tok}"}
    if rng:
        headers["Range"] = rng
    status, _, body = http("GET", f"{cas}/v{version}/reconstructions/{fh}", headers=headers)
    return status, json.loads(body) if status == 200 else body


@pytest.fixture
def hand_file(hub_bucket: HubBucket) -> str:
    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(CHUNKS)
    fh, segs, verif = the_file()
    upload_xorb(cas, tok, xh, body)
    assert post_shard(cas, tok, build_shard([(fh, segs, verif)], [(xh, CHUNKS)]))[0] == 200
    line = {"type": "addFile", "path": "f", "xetHash": fh, "mtime": 1}
    http(
        "POST",
        f"{hub.endpoint}/api/buckets/{bid}/batch",
        json.dumps(line).encode(),
        {"Authorization": f"Bearer {hub.write_token}"},
    )
    return fh


@pytest.mark.parametrize("version", [1, 2])
def test_reconstruction_ranges_and_fetch(hub_bucket: HubBucket, hand_file: str, version: int) -> None:
    full = b"".join(CHUNKS)
    c0 = len(CHUNKS[0])
    start, end = c0 + 10, c0 + len(CHUNKS[1]) - 1  # inside the second chunk only
    status, plan = _reconstruct(hub_bucket, hand_file, f"bytes={start}-{end}", version)
    assert status == 200
    assert plan["offset_into_first_range"] == 10
    assert [t["range"] for t in plan["terms"]] == [{"start": 1, "end": 2}]
    assert plan["terms"][0]["unpacked_length"] == len(CHUNKS[1])
    fetches = plan["xorbs"] if version == 2 else plan["fetch_info"]
    ((_xh, entries),) = fetches.items()
    if version == 2:
        url, br = entries[0]["url"], entries[0]["ranges"][0]["bytes"]
    else:
        url, br = entries[0]["url"], entries[0]["url_range"]
    status, _, raw = http("GET", url, headers={"Range": f"bytes={br['start']}-{br['end']}"})
    assert status == 206 and raw == chunk_bytes(CHUNKS[1], 1)  # end-inclusive byte range
    assert lz4.frame.decompress(raw[8:])[10 : 10 + end - start + 1] == full[start : end + 1]
    status, whole = _reconstruct(hub_bucket, hand_file, None, version)
    assert [t["range"] for t in whole["terms"]] == [{"start": 0, "end": 3}]
    assert _reconstruct(hub_bucket, hand_file, f"bytes={len(full)}-{len(full) + 5}", version)[0] == 416
    # a fetch URL whose signature was tampered with is refused
    assert http("GET", url.replace("s=", "s=0"), headers={"Range": "bytes=0-7"})[0] == 403


def test_read_xet_token_cannot_upload_and_cas_needs_a_token(hub_bucket: HubBucket) -> None:
    cas, read_tok = xet_token(hub_bucket, "read")
    xh, body = build_xorb(CHUNKS)
    assert upload_xorb(cas, read_tok, xh, body)[0] == 403
    assert http("POST", f"{cas}/v1/xorbs/default/{xh}", body)[0] == 401
    assert upload_xorb(cas, read_tok + "x", xh, body)[0] == 401


def test_reconstruction_of_a_file_outside_the_token_bucket_is_404(
    hub_bucket: HubBucket, hand_file: str
) -> None:
    other = f"{hub_bucket.hub.namespace}/other-{hub_bucket.bucket_id[-8:]}"
    hub_bucket.api.create_bucket(other, private=True)
    status, _ = _reconstruct(HubBucket(hub_bucket.hub, other), hand_file, None, 2)
    assert status == 404


def test_oversized_request_is_refused_before_reading_it(hub_bucket: HubBucket) -> None:
    _cas, tok = xet_token(hub_bucket)
    host, port = hub_bucket.hub.endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /cas/v1/xorbs/default/{'ab' * 32} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {tok}\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n".encode()
        )
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("recursive", [False, True])
def test_tree_pages_never_repeat_or_skip_entries(hub_bucket: HubBucket, recursive: bool) -> None:
    """Small pages (limit=2) over names that sort around directories ('a-b' < 'a/x' < 'a0')."""
    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    paths = ["a-b", "a/x", "a/y/z", "a/zz", "a0", "b/c", "b/d", "c", "d/e/f", "d/g"]
    hub_bucket.api.batch_bucket_files(bid, add=[(p.encode(), p) for p in paths])
    url: str | None = f"{hub.endpoint}/api/buckets/{bid}/tree?limit=2&recursive={str(recursive).lower()}"
    seen: list[tuple[str, str]] = []
    pages = 0
    while url:
        status, headers, body = http("GET", url, headers={"Authorization": f"Bearer {hub.write_token}"})
        assert status == 200
        page = json.loads(body)
        assert 1 <= len(page) <= 2
        seen += [(e["type"], e["path"]) for e in page]
        link = headers.get("Link", "")
        url = link[1 : link.index(">")] if 'rel="next"' in link else None
        pages += 1
    if recursive:
        assert seen == [("file", p) for p in sorted(paths)]
    else:
        expected = {("file", "a-b"), ("directory", "a"), ("file", "a0"), ("directory", "b"), ("file", "c")}
        assert sorted(seen) == sorted(expected | {("directory", "d")})
        assert len(seen) == len(set(seen))
    assert pages == (len(seen) + 1) // 2


def test_resolve_serves_any_byte_range(hub_bucket: HubBucket) -> None:
    import random
    from urllib.parse import quote

    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    data = b"".join(bytes([i % 256]) * 5000 + os.urandom(5000) for i in range(120))  # ~1.2 MB, many chunks
    hub_bucket.api.batch_bucket_files(bid, add=[(data, "r/a%2Fb@1")])
    url = f"{hub.endpoint}/buckets/{bid}/resolve/{quote('r/a%2Fb@1', safe='')}"
    auth = {"Authorization": f"Bearer {hub.write_token}"}
    rng = random.Random(3)
    cases = [(0, 0), (0, len(data) - 1), (len(data) - 1, len(data) - 1)]
    cases += [tuple(sorted(rng.randrange(len(data)) for _ in range(2))) for _ in range(25)]
    for a, b in cases:
        status, headers, body = http("GET", url, headers={**auth, "Range": f"bytes={a}-{b}"})
        assert (status, body) == (206, data[a : b + 1]), (a, b)
        assert headers["Content-Range"] == f"bytes {a}-{b}/{len(data)}"
    assert http("GET", url, headers={**auth, "Range": "bytes=-100"})[2] == data[-100:]
    assert http("GET", url, headers={**auth, "Range": f"bytes={len(data) - 10}-"})[2] == data[-10:]
    assert http("GET", url, headers=auth)[2] == data
    assert http("GET", url, headers={**auth, "Range": f"bytes={len(data)}-"})[0] == 416
    assert http("GET", url, headers={**auth, "Range": "bytes=0-1,5-6"})[0] == 416
    status, headers, body = http("HEAD", url, headers=auth)
    assert status == 200 and headers["X-Linked-Size"] == str(len(data)) and body == b""


def _big_chunks(n: int = 20) -> list[bytes]:
    return [os.urandom(100_000) for _ in range(n)]  # ~2 MB: above the zero-copy threshold


def test_large_xorbs_take_the_zero_copy_path_and_are_still_verified(hub_bucket: HubBucket) -> None:
    assert hub_bucket.hub.stats()["zero_copy_uploads"] is True  # Linux: splice is available
    cas, tok = xet_token(hub_bucket)
    chunks = _big_chunks()
    xh, body = build_xorb(chunks)
    other, _ = build_xorb(chunks[:-1])
    status, headers, msg = upload_xorb(cas, tok, other, body)
    assert status == 400 and headers.get("X-Error-Code") == "InvalidXorb" and b"hashes to" in msg
    assert headers.get("Connection") == "close"  # the parser never saw the body: no reuse
    tampered = bytearray(body)
    tampered[len(body) // 2] ^= 1
    assert upload_xorb(cas, tok, xh, bytes(tampered))[0] == 400
    assert json.loads(upload_xorb(cas, tok, xh, body)[2]) == {"was_inserted": True}
    assert json.loads(upload_xorb(cas, tok, xh, body)[2]) == {"was_inserted": False}
    stored = hub_bucket.hub.data_dir / "xorbs" / xh[:2] / xh
    assert stored.read_bytes() == body
    assert not list((hub_bucket.hub.data_dir / "xorbs").rglob(".tmp-*"))


def test_a_body_cut_short_leaves_nothing_behind(hub_bucket: HubBucket) -> None:
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(_big_chunks())
    host, port = hub_bucket.hub.endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /cas/v1/xorbs/default/{xh} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {tok}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        s.sendall(body[: len(body) // 2])
        s.shutdown(socket.SHUT_WR)  # the client gives up half way
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400")
    assert not list((hub_bucket.hub.data_dir / "xorbs").rglob(".tmp-*"))
    assert not (hub_bucket.hub.data_dir / "xorbs" / xh[:2] / xh).exists()
    assert upload_xorb(cas, tok, xh, body)[0] == 200  # and the server carries on


def test_a_received_xorb_is_written_back_as_it_comes(
    hub_bucket: HubBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk starts on a xorb's bytes every WRITEBACK_STEP while the body comes in (the fsync
    before the reply then has less left to write), on the zero-copy path and the ordinary one."""
    from kvbucket.testing.hub_emulator import state

    started: list[tuple[int, int]] = []
    monkeypatch.setattr(state, "start_writeback", lambda fd, off, n: started.append((off, n)))
    monkeypatch.setattr(state, "WRITEBACK_STEP", 1 << 20)
    cas, tok = xet_token(hub_bucket)
    xh, body = build_xorb(_big_chunks(50))  # ~5 MB, spliced
    assert json.loads(upload_xorb(cas, tok, xh, body)[2]) == {"was_inserted": True}
    assert started and started[0][0] == 0 and all(n >= 1 << 20 for _, n in started)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(started))  # in order
    assert len(body) - (1 << 20) < started[-1][0] + started[-1][1] <= len(body)
    assert (hub_bucket.hub.data_dir / "xorbs" / xh[:2] / xh).read_bytes() == body

    started.clear()
    st = state.State(hub_bucket.hub.data_dir / "unit")
    data = os.urandom(5 * (1 << 20) + 7)
    from kvbucket.testing.hub_emulator.xet import XorbIndex

    assert st.put_xorb(XorbIndex("ab" * 32, [0, len(data)], [len(data)], [bytes(32)]), data)
    assert started == [(k << 20, 1 << 20) for k in range(5)]  # the last 7 bytes: the fsync's
    assert st.xorb_path("ab" * 32).read_bytes() == data
    st.close()


def test_writeback_is_available_on_linux(tmp_path: Path) -> None:
    """On Linux the head start is real: libc's sync_file_range is found and accepts the call."""
    import sys

    from kvbucket.testing.hub_emulator.state import _sync_file_range

    fn = _sync_file_range()
    if not sys.platform.startswith("linux"):
        assert fn is None
        return
    with open(tmp_path / "f", "wb") as f:
        f.write(os.urandom(1 << 16))
        f.flush()
        assert fn(f.fileno(), 0, 1 << 16, 2) == 0


def test_a_spliced_xorb_is_fsynced_on_the_disk_pool_before_it_is_stored(
    hub_bucket: HubBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fsync runs on the disk pool (alongside the verification, not after it), on the temp
    file, before the xorb is renamed into place and acknowledged; a bad xorb is still refused."""
    from kvbucket.testing.hub_emulator import state

    events: list[tuple[str, str]] = []
    real_fsync, real_put = state.fsync_file, state.State.put_xorb_file

    def fsync(path: str) -> None:
        events.append(("fsync", threading.current_thread().name))
        assert Path(path).name.startswith(".tmp-")
        real_fsync(path)

    def put(self: state.State, idx: Any, tmp: str, synced: bool = False) -> bool:
        events.append(("store", "synced" if synced else "not synced"))
        return real_put(self, idx, tmp, synced)

    monkeypatch.setattr(state, "fsync_file", fsync)
    monkeypatch.setattr(state.State, "put_xorb_file", put)
    cas, tok = xet_token(hub_bucket)
    chunks = _big_chunks()
    xh, body = build_xorb(chunks)
    other, _ = build_xorb(chunks[:-1])
    assert upload_xorb(cas, tok, other, body)[0] == 400  # the wrong hash: refused, nothing stored
    assert [e[0] for e in events] == ["fsync"]
    assert not (hub_bucket.hub.data_dir / "xorbs" / other[:2] / other).exists()
    events.clear()
    assert json.loads(upload_xorb(cas, tok, xh, body)[2]) == {"was_inserted": True}
    assert [e[0] for e in events] == ["fsync", "store"] and events[1][1] == "synced"
    assert events[0][1].startswith("emu-disk")
    assert (hub_bucket.hub.data_dir / "xorbs" / xh[:2] / xh).read_bytes() == body
    assert not list((hub_bucket.hub.data_dir / "xorbs").rglob(".tmp-*"))
