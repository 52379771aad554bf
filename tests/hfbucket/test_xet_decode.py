"""The compiled Xet decoder against the pure-Python one and the original bytes (stores/hub/xet/decode.py).

Randomized and differential: fetched ranges are built from random bytes and bf16 KV (per-channel
scales, outlier channels), in every chunk scheme (raw, LZ4 frame, byte grouping 4 + LZ4) and
every LZ4 frame option python-lz4 writes (linked or independent blocks, 64 KiB-4 MiB blocks,
block and content checksums, content size, raw blocks of incompressible data, HC levels), with
odd chunk lengths, terms that share chunks, chunks no term uses, and a body that arrives in
pieces across small parse windows. Both decoders lay them out into plain buffers and into
Scatters (several parts, a hash, redirects) and must give the original bytes; damaged ranges
must fail the same way. The same decoders over real hf_xet uploads: tests/hfbucket/
test_hfbucket_store.py (the conformance suite once per decoder).
"""

from __future__ import annotations

import itertools
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lz4.frame
import numpy as np
import pytest
import xxhash

from kvbucket.errors import StoreError
from kvbucket.stores.base import Scatter
from kvbucket.stores.deadline import Abandoned, Gate
from kvbucket.stores.hub.xet import decode as xet_decode
from kvbucket.stores.hub.xet.decode import Window, XetReadUnsupported, copy_range

KERNEL = xet_decode.compiled()  # whatever KVBUCKET_XET_DECODER says (the suite runs once with python)


def test_the_compiled_decoder_is_there() -> None:
    """numba is a dependency: without it every other test here would only compare Python with itself."""
    assert KERNEL is not None and KERNEL.lz4 != 0


def bf16_kv(n: int, rng: np.random.Generator) -> bytes:
    """bf16 K/V as engines store them: Gaussian values, per-channel scales, a few outlier channels."""
    ch = int(rng.choice([64, 128, 1024]))
    rows = max(1, -(-n // (2 * ch)))
    scale = np.exp(rng.normal(0, 0.7, ch)).astype(np.float32)
    scale[rng.choice(ch, max(1, ch // 100), replace=False)] *= 40
    x = (rng.standard_normal((rows, ch), dtype=np.float32) * scale).view(np.uint32)
    bf16 = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)
    return bf16.tobytes()[:n]


def group4(d: bytes) -> bytes:
    a = np.frombuffer(d, np.uint8)
    return b"".join(a[k::4].tobytes() for k in range(4))


FRAME_OPTIONS: list[dict[str, Any]] = [
    {},
    {"block_linked": False},
    {"block_size": lz4.frame.BLOCKSIZE_MAX256KB, "content_checksum": True},
    {"block_checksum": True, "store_size": False},
    {"compression_level": 9, "block_size": lz4.frame.BLOCKSIZE_MAX4MB},
    {"block_size": lz4.frame.BLOCKSIZE_MAX64KB, "block_linked": True, "content_checksum": True,
     "block_checksum": True},
]


def chunk(data: bytes, scheme: int, rng: random.Random) -> bytes:
    if scheme == 0:
        payload = data
    else:
        payload = lz4.frame.compress(group4(data) if scheme == 2 else data, **rng.choice(FRAME_OPTIONS))
    head = bytes([0]) + len(payload).to_bytes(3, "little") + bytes([scheme]) + len(data).to_bytes(3, "little")
    return head + payload


class Pieces:
    """A response body that arrives in pieces of random sizes (what a socket gives)."""

    def __init__(self, body: bytes, rng: random.Random) -> None:
        self.body, self.pos, self.rng = body, 0, rng

    def readinto(self, b: memoryview) -> int:
        n = min(len(b), len(self.body) - self.pos, self.rng.choice([1, 7, 4096, 65_536, 1 << 20]))
        b[:n] = self.body[self.pos : self.pos + n]
        self.pos += n
        return n


class Redirecting(Pieces):
    """A body whose reader redirects part 1 of ``dst`` to ``to`` once ``at`` bytes were read (what
    a load does to a read-ahead on its way: stores/guard/read_ahead.py)."""

    def __init__(self, body: bytes, rng: random.Random, dst: Scatter, at: int, to: np.ndarray) -> None:
        super().__init__(body, rng)
        self.dst, self.at, self.to, self.moved = dst, at, to, False

    def readinto(self, b: memoryview) -> int:
        if self.pos >= self.at and not self.moved:
            self.dst.redirect(1, memoryview(self.to))
            self.moved = True
        return super().readinto(b[:4096])  # small pieces: the redirect comes between two writes


def make_range(seed: int) -> tuple[bytes, list[bytes], tuple[tuple[int, int, int, int], ...], bytes]:
    """A fetched range: its body, its chunks' bytes, terms (first, end, offset, length), the file."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    kind = rng.choice(["bf16", "random", "zeros-and-text", "mixed"])
    chunks: list[bytes] = []
    body = bytearray()
    for _ in range(rng.randint(1, 40)):
        n = rng.choice([1, 2, 3, 4, 5, 7, 64, 1001, 8191, 65_536, 65_537, 100_003, 131_072])
        k = kind if kind != "mixed" else rng.choice(["bf16", "random", "zeros-and-text"])
        if k == "bf16":
            data = bf16_kv(n, nrng)
        elif k == "random":
            data = os.urandom(n)
        else:
            runs = np.repeat(nrng.integers(0, 3, n // 16 + 1, dtype=np.uint8) * 40, 16)[:n]
            data = (runs + (nrng.random(n) < 0.05)).astype(np.uint8).tobytes()  # overlapping matches
        chunks.append(data)
        body += chunk(data, rng.choice([0, 1, 2]), rng)
    # terms: consecutive runs, sometimes a chunk used twice (dedup), sometimes chunks nobody uses
    first = rng.randint(0, min(2, len(chunks) - 1))
    terms, c = [], first
    while c < len(chunks):
        end = rng.randint(c + 1, len(chunks))
        terms.append((c, end))
        if rng.random() < 0.3 and end - c > 1:
            back = rng.randint(c, end - 1)
            terms.append((back, rng.randint(back + 1, end)))  # shares chunks with the term before
        c = end + (1 if rng.random() < 0.2 else 0)
    targets, off, file = [], 0, bytearray()
    for cs, ce in terms:
        part = b"".join(chunks[cs:ce])
        targets.append((cs, ce, off, len(part)))
        file += part
        off += len(part)
    return bytes(body), chunks, tuple(targets), bytes(file)


def read(body: bytes, nchunks: int, targets: Any, dst: Any, fast: Any, seed: int, window: int,
         gate: Gate | None = None) -> None:
    copy_range(Pieces(body, random.Random(seed)), len(body), (0, nchunks), targets, dst, gate, Window(window),
               fast)


@pytest.mark.parametrize("seed", range(40))
def test_both_decoders_give_the_original_bytes_into_plain_buffers(seed: int) -> None:
    body, chunks, targets, file = make_range(seed)
    window = random.Random(seed).choice([140_000, 300_000, xet_decode.WINDOW])
    outs = []
    for fast in (KERNEL, None):
        out = bytearray(b"\xa5" * len(file))
        read(body, len(chunks), targets, memoryview(out), fast, seed, window, Gate() if seed % 2 else None)
        outs.append(bytes(out))
    assert outs[0] == outs[1] == file


@pytest.mark.parametrize("seed", range(40, 70))
def test_both_decoders_fill_scatters_and_feed_their_hash(seed: int) -> None:
    """Parts split at random offsets (chunks straddle them), the hash fed in order, and a
    redirect of the middle part halfway through the range keeps every byte."""
    body, chunks, targets, file = make_range(seed)
    rng = random.Random(seed)
    cuts = sorted({0, len(file), *(rng.randint(0, len(file)) for _ in range(3))})
    for fast in (KERNEL, None):
        parts = [np.full(b - a, 0xA5, np.uint8) for a, b in itertools.pairwise(cuts)]
        dst = Scatter(*parts, hasher=xxhash.xxh3_64())
        redirect = rng.random() < 0.5 and len(parts) > 1
        if redirect:
            dst.allow_redirect()
            moved = np.full(parts[1].size, 0x5A, np.uint8)
            src = Redirecting(body, random.Random(seed), dst, len(body) // 2, moved)
            copy_range(src, len(body), (0, len(chunks)), targets, dst, None, Window(300_000), fast)
            assert src.moved
            parts[1] = moved
        else:
            read(body, len(chunks), targets, dst, fast, seed, 300_000)
        assert b"".join(p.tobytes() for p in parts) == file
        if not dst.rewritten:
            dst.landed(dst.hashed, dst.nbytes)
            assert dst.hasher.intdigest() == xxhash.xxh3_64_intdigest(file)


@pytest.mark.parametrize("fast", [KERNEL, None], ids=["compiled", "python"])
def test_a_window_smaller_than_a_chunk_grows_for_it(fast: Any) -> None:
    """Parse windows are small (256 KiB: hf_xet's chunks are <= 128 KiB); a larger chunk, valid up
    to MAX_CHUNK, makes the window grow with the unparsed bytes kept, in both decoders."""
    rng, nrng = random.Random(9), np.random.default_rng(9)
    data = [bf16_kv(n, nrng) for n in (3_001, 200_003, 5, 600_000, 70_001)]
    body = b"".join(chunk(d, s, rng) for d, s in zip(data, (2, 2, 0, 1, 2), strict=True))
    file = b"".join(data)
    w = Window(4096)
    out = bytearray(len(file))
    copy_range(Pieces(body, random.Random(9)), len(body), (0, len(data)), ((0, len(data), 0, len(file)),),
               memoryview(out), None, w, fast)
    assert bytes(out) == file
    assert len(w.mv) > 600_000  # grew for the largest chunk


@pytest.mark.parametrize("fast", [KERNEL, None], ids=["compiled", "python"])
def test_an_abandoned_read_writes_nothing_through_either_decoder(fast: Any) -> None:
    body, chunks, targets, file = make_range(3)
    out = bytearray(len(file))
    gate = Gate()
    gate.close()
    with pytest.raises(Abandoned):
        read(body, len(chunks), targets, memoryview(out), fast, 3, xet_decode.WINDOW, gate)
    assert out == bytearray(len(file))


class CountingScatter(Scatter):
    """Counts in-place decodes (``fill``) and item writes."""

    fills = writes = 0

    def fill(self, start: int, limit: int, write: Any) -> int:
        self.fills += 1
        return super().fill(start, limit, write)

    def __setitem__(self, key: slice, data: Any) -> None:
        self.writes += 1
        super().__setitem__(key, data)


def test_the_python_decoder_ungroups_in_place() -> None:
    """A byte-grouped chunk is ungrouped by the Python decoder straight into the part that holds
    it (Scatter.fill: hashed, under the redirect lock), only the chunk that straddles two parts
    goes through the window and an item write; the hash is the file's."""
    rng, nrng = random.Random(4), np.random.default_rng(4)
    data = [bf16_kv(n, nrng) for n in (65_536, 70_001, 9, 65_536, 131_072)]
    body = b"".join(chunk(d, 2, rng) for d in data)
    file = b"".join(data)
    cut = 65_536 + 35_000  # inside the second chunk
    parts = [np.zeros(cut, np.uint8), np.zeros(len(file) - cut, np.uint8)]
    dst = CountingScatter(*parts, hasher=xxhash.xxh3_64())
    dst.allow_redirect()
    read(body, len(data), ((0, len(data), 0, len(file)),), dst, None, 4, xet_decode.WINDOW)
    assert b"".join(p.tobytes() for p in parts) == file
    assert (dst.fills, dst.writes) == (len(data), 1)  # every chunk tried in place; one straddled
    assert dst.hashed == len(file) and dst.hasher.intdigest() == xxhash.xxh3_64_intdigest(file)


def damage(body: bytes, rng: random.Random) -> bytes:
    b = bytearray(body)
    how = rng.choice(["flip", "truncate", "extend", "header"])
    if how == "flip":
        for _ in range(rng.randint(1, 20)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del b[rng.randrange(len(b)) :]
    elif how == "extend":
        b += os.urandom(rng.randint(1, 100))
    else:
        b[rng.choice([0, 4, 5])] = rng.choice([1, 3, 0xFF])
    return bytes(b)


@pytest.mark.parametrize("seed", range(100, 160))
def test_damaged_ranges_fail_or_decode_alike(seed: int) -> None:
    """Flipped bits, cut or extended bodies, bad headers: both decoders raise the same kind of
    error, or (a flipped bit inside raw bytes or literals) both give the same bytes."""
    body, chunks, targets, file = make_range(seed)
    bad = damage(body, random.Random(seed))
    got = []
    for fast in (KERNEL, None):
        out = bytearray(len(file))
        try:
            read(bad, len(chunks), targets, memoryview(out), fast, seed, 300_000)
            got.append(("ok", bytes(out)))
        except (StoreError, XetReadUnsupported) as e:
            got.append(("error", type(e)))
    assert got[0] == got[1]


def test_unknown_decoder_setting_is_reported_and_read_as_auto(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(xet_decode.DECODER_ENV, "fastest")
    assert xet_decode.decoder_mode() == "auto"
    assert "KVBUCKET_XET_DECODER" in caplog.text and "python" in caplog.text
    monkeypatch.setenv(xet_decode.DECODER_ENV, "python")
    assert xet_decode.kernel() is None
    monkeypatch.setenv(xet_decode.DECODER_ENV, "numba")
    assert xet_decode.kernel() is KERNEL
    monkeypatch.setenv(xet_decode.DECODER_ENV, "auto")
    assert xet_decode.kernel() is KERNEL  # loaded already: used from now on


def test_real_hf_xet_uploads_decode_alike_into_buffers_scatters_and_sealed_reads(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects uploaded by the real hf_xet (bf16 KV: byte-grouped LZ4; runs: LZ4; random: raw),
    read back by each decoder into fresh buffers, caller buffers, Scatters and through a sealed
    store (header + payload Scatter, hashed as it lands). The compiled decoder decodes every
    chunk itself (no chunk goes the Python way); the Python one decodes them all."""
    from kvbucket.stores.guard.sealed import seal_store
    from kvbucket.stores.hub.config import build_config
    from kvbucket.stores.hub.store import HFBucketStore

    rng = np.random.default_rng(7)
    sizes = [1, 4_097, 65_539, 1_000_003, 3 << 20]
    runs = [np.repeat(rng.integers(0, 4, n // 64 + 1, dtype=np.uint8), 64)[:n].tobytes() for n in sizes[1:3]]
    data = [bf16_kv(n, rng) for n in sizes] + runs
    data += [os.urandom(n) for n in sizes[2:4]]
    names = [f"obj{i}" for i in range(len(data))]
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/dec",
                       token=hub_bucket.hub.write_token, token_env="", endpoint=hub_bucket.hub.endpoint)

    def sealed_store() -> Any:
        return seal_store(HFBucketStore(build_config(
            bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/sealed", token=hub_bucket.hub.write_token,
            token_env="", endpoint=hub_bucket.hub.endpoint)), tier="test")

    with HFBucketStore(cfg) as w:
        assert all(r.ok for r in w.put_many(list(zip(names, data, strict=True))))
        with sealed_store() as sealed:
            assert all(r.ok for r in sealed.put_many(list(zip(names, data, strict=True))))
    real = xet_decode.decompressed  # the pure-Python way's LZ4 step (then ungrouped in place)
    for mode in ("numba", "python"):
        monkeypatch.setenv(xet_decode.DECODER_ENV, mode)
        calls: list[int] = []

        def counting(scheme: int, payload: memoryview, n: int, calls: list[int] = calls) -> Any:
            calls.append(scheme)
            return real(scheme, payload, n)

        monkeypatch.setattr(xet_decode, "decompressed", counting)
        with HFBucketStore(cfg) as s:
            got = s.get_many(names)
            assert [bytes(r.data) for r in got] == data
            bufs = [np.full(len(d), 0xA5, np.uint8) for d in data]
            assert all(r.ok for r in s.get_many(names, bufs))
            assert [b.tobytes() for b in bufs] == data
            scat = [Scatter(bytearray(len(d) // 3), bytearray(len(d) - len(d) // 3)) for d in data]
            assert all(r.ok for r in s.get_many(names, scat))
            assert [bytes(x.parts[0]) + bytes(x.parts[1]) for x in scat] == data
        with sealed_store() as s:
            bufs = [np.empty(len(d), np.uint8) for d in data]
            got = s.get_many(names, bufs)
            assert all(r.ok for r in got), [r.error for r in got]
            assert [b.tobytes() for b in bufs] == data
        if mode == "numba":
            assert calls == []
        else:
            assert {1, 2} <= set(calls)  # hf_xet compressed some chunks each way


@pytest.mark.parametrize("fast", [KERNEL, None], ids=["compiled", "python"])
def test_a_closed_redirectable_scatter_takes_no_late_decode(fast: Any) -> None:
    """A read-ahead's Scatter closed (its read is over) refuses a late writer's in-place decode
    as it refuses item writes: nothing lands."""
    body, chunks, targets, file = make_range(5)
    part = np.zeros(len(file), np.uint8)
    dst = Scatter(part)
    dst.allow_redirect()
    dst.close()
    with pytest.raises(Abandoned):
        read(body, len(chunks), targets, dst, fast, 5, xet_decode.WINDOW)
    assert not part.any()


_COLD_LOAD = r"""
import hashlib, sys, json, time
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import decode
bucket, prefix, token, endpoint, expect, opts = sys.argv[1:7]
opts = json.loads(opts)
for k, v in opts.pop("decode", {}).items():
    setattr(decode, k, v)
started = []
load = decode.compiled
def compiled():
    started.append(time.monotonic())  # the compiled decoder's load begins
    return load()
decode.compiled = compiled
cfg = build_config(bucket_handle=f"hf://buckets/{bucket}/{prefix}", token=token, token_env="",
                   endpoint=endpoint, **opts)
with HFBucketStore(cfg) as s:
    got = s.get_many([f"o{i}" for i in range(4)])
    ended = time.monotonic()
    during = "numba" in sys.modules
    ok = [hashlib.sha256(bytes(r.data)).hexdigest() for r in got] == json.loads(expect)
    asked = decode._loading is not None
    if asked:
        decode._loading.result(timeout=60)  # loads once the reads are idle
print(json.dumps({"ok": ok, "during": during, "numba": "numba" in sys.modules,
                  "began_in_hit": bool(started) and started[0] < ended}))
"""


def _store_and_cold_load(hub_bucket: Any, prefix: str, compression: str,
                         opts: dict[str, Any]) -> dict[str, Any]:
    """Store four bf16 KV objects (``compression``), then load them in a fresh process (``auto``
    decoder, store options and decode.py constants from ``opts``): what it saw. Each prefix has its
    own bytes (the same bytes would be deduplicated against chunks stored another way)."""
    import hashlib
    import json
    import subprocess
    import sys

    from kvbucket.stores.hub.config import build_config
    from kvbucket.stores.hub.store import HFBucketStore

    rng = np.random.default_rng(list(prefix.encode()))
    data = [bf16_kv(n, rng) for n in (70_001, 1 << 20, 2 << 20, 3)]
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/{prefix}",
                       token=hub_bucket.hub.write_token, token_env="", endpoint=hub_bucket.hub.endpoint,
                       xet_compression=compression)
    with HFBucketStore(cfg) as w:
        assert all(r.ok for r in w.put_many([(f"o{i}", d) for i, d in enumerate(data)]))
    env = {**os.environ, xet_decode.DECODER_ENV: "auto"}
    out = subprocess.run(
        [sys.executable, "-c", _COLD_LOAD, hub_bucket.bucket_id, prefix, hub_bucket.hub.write_token,
         hub_bucket.hub.endpoint, json.dumps([hashlib.sha256(d).hexdigest() for d in data]),
         json.dumps(opts)],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"], out.stderr[-2000:]
    return got


def test_uncompressed_loads_never_import_numba(hub_bucket: Any) -> None:
    """A fresh process's first hit of objects stored uncompressed loads no decoder (numba's import
    alone holds the GIL for 0.3 s); one of compressed objects asks for it, and it loads after the
    hit (numba not imported while the hit runs); both give the right bytes."""
    seen: dict[str, bool] = {}
    for prefix, compression in (("raw", "none"), ("packed", "bg4-lz4")):
        got = _store_and_cold_load(hub_bucket, prefix, compression, {})
        assert not got["during"], compression
        assert not got["began_in_hit"], compression
        seen[compression] = got["numba"]
    assert seen == {"none": False, "bg4-lz4": True}


def test_a_big_compressed_hit_waits_for_the_compiled_decoder(hub_bucket: Any) -> None:
    """decode.py's big-hit invariant: with the fetches in progress at BIG_HIT_BYTES or more, the
    first compressed chunk loads the compiled decoder then and there, while the hit runs (numba
    imported before it ends); below it the load waits for the reads to be idle (after the hit),
    and a big hit of raw chunks loads nothing. The hit is made long (1 MiB parts fetched one at a
    time, 0.3 s each) and the idle rule slow (IDLE_SECS 5 s), so a load begun during the hit is the
    big-hit rule's and nothing else's."""
    hub_bucket.hub.faults.add("fetch", latency_s=0.3)

    def opts(big_hit_bytes: int) -> dict[str, Any]:
        return {"read_connections": 1, "read_part_bytes": 1 << 20, "load_timeout_secs": 60.0,
                "decode": {"IDLE_SECS": 5.0, "LOAD_WAIT_SECS": 10.0, "BIG_HIT_BYTES": big_hit_bytes}}

    # The three fresh processes run at once, each on its own prefix: each mostly waits (its 0.3 s
    # fetches one at a time; the small hit's load, IDLE_SECS after it)
    cases = [("big", "bg4-lz4", opts(1 << 20)),  # the hit fetches ~3 MiB
             ("small", "bg4-lz4", opts(64 << 20)), ("raw", "none", opts(1 << 20))]
    with ThreadPoolExecutor(len(cases)) as pool:
        big, small, raw = pool.map(lambda case: _store_and_cold_load(hub_bucket, *case), cases)
    assert big["began_in_hit"] and big["during"] and big["numba"]
    assert not small["began_in_hit"] and small["numba"]
    assert not raw["began_in_hit"] and not raw["numba"] and not raw["during"]


def test_a_late_object_keeps_the_decoder_load_after_the_hit(hub_bucket: Any) -> None:
    """A small hit's load waits until no object is being read: with one of its four fetches
    answered 0.6 s late, the others decoded meanwhile leave no range decoding for longer than
    IDLE_SECS, and the load (0.3-0.5 s of CPU holding the GIL) began inside the hit before."""
    hub_bucket.hub.faults.add("fetch", nth=1, latency_s=0.6)
    got = _store_and_cold_load(hub_bucket, "late", "bg4-lz4", {})
    assert hub_bucket.hub.faults.rules()[0]["fired"] == 1
    assert not got["began_in_hit"] and not got["during"] and got["numba"]



_FORK_DURING_LOAD = r"""
import os, sys, threading, time
from kvbucket.stores.hub.xet import decode
threading.Thread(target=decode.compiled, daemon=True).start()
time.sleep(float(sys.argv[1]))  # inside the load: numba's import and the kernel take 0.3 s or more
pid = os.fork()
if pid == 0:
    k = decode.compiled()  # before the fix: waited forever on the kernel module's import lock
    os._exit(0 if k is not None else 3)
t = time.monotonic()
while time.monotonic() - t < 60:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(4)
"""


@pytest.mark.parametrize("delay", [0.02, 0.15])
def test_a_fork_during_the_decoders_load_gets_the_decoder_in_the_child(delay: float) -> None:
    """An outside tester forked 0.15-0.45 s after a hit started the background load: the child
    waited forever on the kernel module's import lock (held by the parent's loading thread, which
    the child does not have) or decoded the Python way for its life. A fork now waits for the
    load to end, and the child has the compiled decoder."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FORK_DURING_LOAD, str(delay)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "KVBUCKET_XET_DECODER": "auto"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
