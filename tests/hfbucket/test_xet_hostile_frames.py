"""The two Xet decoders on hostile LZ4 frames, and malformed reconstructions (issue 39).

Valid frames (every option python-lz4 writes, raw and byte-grouped chunks) are mutated: FLG and
BD bits, the header checksum byte, content sizes (top bit set, zero, off by a bit), block sizes
and the raw-block bit, blocks larger than the frame's block size, end marks, flipped payload
bits, cut and extended frames; about half get their header checksum recomputed so the checks
behind it are reached. The compiled decoder (with the C block decoder and with its own) may
decline a chunk (it then goes the Python way); it must never accept one the Python decoder
refuses, and what it accepts must be the Python decoder's bytes. Through ``copy_range`` both
give the same bytes or both a ``StoreError``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import lz4.frame
import numpy as np
import pytest
import xxhash

from kvbucket.errors import StoreError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import decode as xet_decode
from kvbucket.stores.hub.xet.decode import Window, XetReadUnsupported, copy_range
from kvbucket.stores.hub.xet.reads import parse_reconstruction

KERNEL = xet_decode.compiled()
MAGIC = bytes.fromhex("04224d18")
OPTIONS: list[dict[str, Any]] = [
    {}, {"block_linked": False}, {"block_linked": False, "store_size": False},
    {"block_size": lz4.frame.BLOCKSIZE_MAX64KB, "block_linked": True},
    {"block_size": lz4.frame.BLOCKSIZE_MAX256KB, "block_linked": False},
    {"content_checksum": True}, {"block_checksum": True, "store_size": False},
]
MUTATIONS = ("flg", "bd", "hc", "size", "size-top", "size-zero", "block-size", "raw-bit", "big-block",
             "end-mark", "flip", "cut", "extend")


def group4(d: bytes) -> bytes:
    a = np.frombuffer(d, np.uint8)
    return b"".join(a[k::4].tobytes() for k in range(4))


def sample(rng: random.Random, n: int) -> bytes:
    kind = rng.choice(["random", "runs", "text"])
    if kind == "random":
        return os.urandom(n)
    if kind == "runs":
        step = rng.choice([3, 17, 200])
        return bytes((i // step) % 7 for i in range(n))
    return ((b"kv %d " % rng.randint(0, 9)) * (n // 5 + 1))[:n]


def header_len(frame: bytes | bytearray) -> int:
    return 7 + (8 if frame[4] & 0x08 else 0)


def reseal(b: bytearray) -> None:
    """Recompute the header checksum byte (so a changed FLG, BD or size reaches the next check)."""
    if len(b) < 7:
        return
    hl = header_len(b)
    if b[:4] == MAGIC and len(b) >= hl:
        b[hl - 1] = (xxhash.xxh32_intdigest(bytes(b[4 : hl - 1])) >> 8) & 0xFF


def mutate(frame: bytes, how: str, rng: random.Random) -> bytes:
    b = bytearray(frame)
    hl = header_len(b)
    if how == "flg":
        b[4] ^= 1 << rng.randrange(8)
    elif how == "bd":
        b[5] = rng.randrange(256)
    elif how == "hc":
        b[hl - 1] = (b[hl - 1] + rng.randint(1, 255)) % 256
    elif how in ("size", "size-top", "size-zero"):
        if not b[4] & 0x08:
            b[4] |= 0x08
            b[6:6] = len(frame).to_bytes(8, "little")
        if how == "size":
            b[6 + rng.randrange(8)] ^= 1 << rng.randrange(8)
        elif how == "size-top":
            b[13] |= 0x80
        else:
            b[6:14] = bytes(8)
    elif how == "raw-bit" and len(b) >= hl + 4:
        b[hl + 3] ^= 0x80  # a compressed block read as raw, or the reverse
    elif how == "block-size" and len(b) >= hl + 4:
        b[hl + rng.randrange(4)] ^= 1 << rng.randrange(8)
    elif how == "big-block":
        b[5] = 0x40  # a 64 KiB block size over blocks that may be larger
    elif how == "end-mark":
        b[-4:] = (0x80000000).to_bytes(4, "little")
    elif how == "flip":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif how == "cut":
        del b[rng.randrange(len(b)) :]
    elif how == "extend":
        b += os.urandom(rng.randint(1, 8))
    if how != "hc" and rng.random() < 0.5:
        reseal(b)
    return bytes(b)


def chunk_bytes(scheme: int, payload: bytes, n: int) -> bytes:
    head = bytes([0]) + len(payload).to_bytes(3, "little") + bytes([scheme]) + n.to_bytes(3, "little")
    return head + payload


def compiled(scheme: int, payload: bytes, n: int, lz4: int) -> bytes | None:
    """The compiled decoder's bytes for one chunk, or None when it declines it."""
    assert KERNEL is not None
    win = np.frombuffer(chunk_bytes(scheme, payload, n), np.uint8).copy()
    out = np.zeros(xet_decode.MAX_CHUNK, np.uint8)
    info = np.zeros(5, np.int64)
    KERNEL.run(lz4, win, 0, win.size, 1, out, 0, out.size, np.empty(xet_decode.MAX_CHUNK, np.uint8),
               xet_decode.MAX_CHUNK, info)
    return out[:n].tobytes() if info[3] == KERNEL.outcomes[0] else None


def python(scheme: int, payload: bytes, n: int) -> bytes | None:
    """The Python decoder's bytes, or None when it refuses (a StoreError and nothing else)."""
    try:
        data = bytes(xet_decode.decode_chunk(scheme, memoryview(payload), n))
    except StoreError:
        return None
    return data if len(data) == n else None


def pipeline(scheme: int, payload: bytes, n: int, fast: Any) -> bytes | type:
    body = chunk_bytes(scheme, payload, n)

    class Once:
        def __init__(self) -> None:
            self.pos = 0

        def readinto(self, b: memoryview) -> int:
            k = min(len(b), len(body) - self.pos)
            b[:k] = body[self.pos : self.pos + k]
            self.pos += k
            return k

    out = bytearray(n)
    try:
        copy_range(Once(), len(body), (0, 1), ((0, 1, 0, n),), memoryview(out), None, Window(), fast)  # type: ignore[arg-type]
    except (StoreError, XetReadUnsupported) as e:
        return type(e)
    return bytes(out)


@pytest.mark.parametrize("seed", range(5))
def test_the_compiled_decoder_never_accepts_a_frame_the_python_one_refuses(seed: int) -> None:
    assert KERNEL is not None and KERNEL.lz4 != 0
    rng = random.Random(seed)
    refused = accepted = 0
    for i in range(400):
        n = rng.choice([0, 1, 5, 13, 64, 1000, 65_536, 70_000, 131_072])
        scheme = rng.choice([1, 2])
        data = sample(rng, n)
        frame = lz4.frame.compress(group4(data) if scheme == 2 else data, **rng.choice(OPTIONS))
        how = MUTATIONS[i % len(MUTATIONS)]
        bad = mutate(frame, how, rng)
        want = python(scheme, bad, n)
        refused += want is None
        for lz4_fn in (KERNEL.lz4, 0):  # the C block decoder, then the compiled one's own
            got = compiled(scheme, bad, n, lz4_fn)
            if got is not None:
                accepted += 1
                assert got == want, (seed, i, how, lz4_fn, bad[:24].hex())
        if i % 8 == 0:  # the whole path a load takes: the same bytes, or both refuse
            assert pipeline(scheme, bad, n, KERNEL) == pipeline(scheme, bad, n, None), (seed, i, how)
    assert refused > 100 and accepted > 50  # both kinds were really exercised


@pytest.mark.parametrize("how", ["hc", "bd-reserved", "bd-small", "size-top", "big-block"])
def test_frames_liblz4_refuses_are_declined_by_the_compiled_decoder(how: str) -> None:
    """One frame per rule the compiled decoder did not check before (each accepted then)."""
    data = sample(random.Random(7), 200_000)[:100_000]
    b = bytearray(lz4.frame.compress(data, block_linked=False, block_size=lz4.frame.BLOCKSIZE_MAX256KB))
    if how == "hc":
        b[header_len(b) - 1] ^= 0xFF
    elif how == "bd-reserved":
        b[5] |= 0x01
    elif how == "bd-small":
        b[5] = 0x30  # block size id 3: not one liblz4 knows
    elif how == "size-top":  # python-lz4 stores the size (FLG bit 3): the old kernel read it as "none"
        b[6:14] = ((1 << 63) | len(data)).to_bytes(8, "little")
    else:
        b[5] = 0x40  # 64 KiB blocks announced, a 100,000-byte block follows
    if how != "hc":
        reseal(b)
    assert python(1, bytes(b), len(data)) is None
    assert KERNEL is not None
    assert compiled(1, bytes(b), len(data), KERNEL.lz4) is None
    assert compiled(1, bytes(b), len(data), 0) is None


@pytest.mark.parametrize("field, value", [
    ("terms/0/unpacked_length", -1), ("terms/0/range/end", -3), ("terms/0/range/start", 10**6),
    ("offset_into_first_range", -1), ("terms/0/unpacked_length", "12"),
])
def test_malformed_reconstruction_values_are_store_errors(field: str, value: Any) -> None:
    body = {"offset_into_first_range": 0,
            "terms": [{"hash": "x", "unpacked_length": 10, "range": {"start": 0, "end": 1}},
                      {"hash": "x", "unpacked_length": 5, "range": {"start": 1, "end": 2}}],
            "fetch_info": {"x": [{"range": {"start": 0, "end": 2}, "url": "http://h/x",
                                  "url_range": {"start": 0, "end": 99}}]}}
    parse_reconstruction(body, 15, 0.0)  # as served: fine
    from kvbucket.testing.hub_emulator.faults import set_json

    with pytest.raises(StoreError):
        parse_reconstruction(set_json(body, {field: value}), 15, 0.0)
    with pytest.raises(StoreError):
        parse_reconstruction([], 15, 0.0)  # type: ignore[arg-type]


def test_a_negative_unpacked_length_from_the_hub_is_a_store_error_for_that_load(
    hub_bucket: Any, hub_faults: Any
) -> None:
    """The emulator serves a reconstruction of two terms whose lengths still add up to the
    object's size, the first negative (the second term's offset is then negative too)."""
    hub = hub_bucket.hub
    store = HFBucketStore(build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}",
                                       token=hub.write_token, token_env="", endpoint=hub.endpoint,
                                       breaker_failures=0))
    try:
        first = os.urandom(2 << 20)
        data = first + os.urandom(2 << 20)  # its first half dedups against "first": two terms
        assert store.put_many([("first", first)])[0].ok
        assert store.put_many([("obj", data)])[0].ok
        hub_faults.add("reconstruction", json_set={"terms/0/unpacked_length": -1,
                                                   "terms/1/unpacked_length": len(data) + 1})
        store._client.reset_download_group()
        (r,) = store.get_many(["obj"], [bytearray(len(data))])
        assert not r.found and isinstance(r.error, StoreError), r.error
        assert "negative" in str(r.error) and "unpacked_length" in str(r.error)
        assert hub_faults.rules()[0]["fired"] >= 1
        hub_faults.reset()
        (r,) = store.get_many(["obj"])  # a fresh reconstruction: the object itself is intact
        assert r.found and bytes(r.data) == data
    finally:
        store.close()
