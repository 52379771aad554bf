"""The envelope format and the sealing layer's rules, on the in-memory store (unit tests)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbucket import envelope as env
from kvbucket.stores.base import Scatter
from kvbucket.stores.guard.sealed import SealedStore, inspect_object, seal_store, tenant_of_name
from kvbucket.stores.local.memory import MemoryStore


def sealed() -> tuple[SealedStore, MemoryStore]:
    raw = MemoryStore()
    return seal_store(raw, tier="unit", identity="layout-x"), raw


def test_header_is_64_bytes_and_round_trips() -> None:
    h = env.pack_header(1234, 0xDEADBEEF, "a/b", env.identity_digest("x"), key_id=7, nonce=b"n" * 12)
    assert len(h) == env.HEADER_SIZE and h[:4] == env.MAGIC
    parsed = env.parse_header(h, "a/b")
    got = (parsed.payload_len, parsed.checksum, parsed.key_id, parsed.nonce)
    assert got == (1234, 0xDEADBEEF, 7, b"n" * 12)
    assert parsed.encrypted and parsed.identity == env.identity_digest("x")


@pytest.mark.parametrize("offset", range(env.HEADER_SIZE))
def test_every_header_byte_is_covered(offset: int) -> None:
    """Flipping any one header byte is refused: unsealed for the magic, version for the version
    byte (checked before the header check: a newer format is kept, never judged damaged), else
    header damage."""
    h = bytearray(env.pack_header(10, 1, "n"))
    h[offset] ^= 0x01
    with pytest.raises(env.EnvelopeError) as info:
        env.parse_header(h, "n")
    assert info.value.reason == {0: "unsealed", 1: "unsealed", 2: "unsealed", 3: "unsealed",
                                 4: "version"}.get(offset, "header")


@pytest.mark.parametrize("data", [b"K", b"KV", b"KVB", b"KVBE", b"KVBE notes: a file kvbucket never wrote\n",
                                  b"KVBE notes\n" * 10, b"KVBE\x02" + bytes(80)])
def test_only_kvbuckets_own_chunks_are_damaged_chunks(data: bytes) -> None:
    """Prefixes of the magic, a "KVBE..." text file and a future format are not damage: kept by a
    load (a miss, never removed) and by ``verify``'s classifier (never "corrupt")."""
    from kvbucket.stores.guard.envelope_open import inspect_object

    s, raw = sealed()
    raw.put("k", data)
    assert s.get("k") is None
    buf = bytearray(max(0, len(data) - env.HEADER_SIZE) or 1)
    s.get_many(["k"], [buf])
    assert raw.get("k") == data  # kept, by the whole read and by the read into a buffer
    assert inspect_object("k", data)[0] in ("legacy", "foreign")
    with pytest.raises(env.EnvelopeError) as info:
        env.parse_header(data[: env.HEADER_SIZE], "k")
    assert info.value.reason in ("unsealed", "version")


def test_a_short_envelope_of_a_known_version_is_truncated() -> None:
    s, raw = sealed()
    raw.put("k", env.pack_header(10, 1, "k")[:20])
    with pytest.raises(env.EnvelopeError) as info:
        env.parse_header(raw.get("k"), "k")
    assert info.value.reason == "truncated"
    assert s.get("k") is None and raw.get("k") is None  # damage: removed


def test_unknown_version_and_other_name() -> None:
    body = struct.pack("<4sBBBBQQ12s8sI12s", env.MAGIC, 2, 0, 1, 0, 0, 0, env.name_digest("n"), bytes(8), 0,
                       bytes(12))
    import xxhash

    h = body + struct.pack("<I", xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF)
    with pytest.raises(env.EnvelopeError, match="format 2") as info:
        env.parse_header(h, "n")
    assert info.value.reason == "version"
    with pytest.raises(env.EnvelopeError) as info:
        env.parse_header(env.pack_header(1, 1, "n"), "other")
    assert info.value.reason == "name"


def test_loads_go_straight_into_the_callers_buffer() -> None:
    s, raw = sealed()
    data = np.arange(4096, dtype=np.uint16)
    assert s.put("k", data) == data.nbytes
    assert raw.head("k") == data.nbytes + env.HEADER_SIZE and s.head("k") == data.nbytes
    out = np.zeros_like(data)
    (r,) = s.get_many(["k"], [out])
    assert r.found and r.data is out and (out == data).all()
    (whole,) = s.get_many(["k"])
    assert bytes(whole.data) == data.tobytes()
    assert [(i.name, i.size) for i in s.list()] == [("k", data.nbytes)]


def test_a_valid_chunk_of_another_size_is_a_size_mismatch_not_damage() -> None:
    s, raw = sealed()
    s.put("k", b"x" * 100)
    buf = bytearray(b"\x07" * 80)
    (r,) = s.get_many(["k"], [buf])
    assert r.error is not None and "100 bytes" in str(r.error)
    assert buf == bytearray(b"\x07" * 80) and raw.exists("k")  # untouched, kept


def test_refused_objects_are_logged_once_by_name_never_bytes(caplog: pytest.LogCaptureFixture) -> None:
    s, raw = sealed()
    secret = b"user prompt: the launch code is 1234" * 10
    for _ in range(3):
        s.put("k", secret)
        blob = bytearray(raw.get("k") or b"")
        blob[-1] ^= 1
        raw.put("k", blob)
        assert s.get("k") is None
    msgs = [r.getMessage() for r in caplog.records if "integrity" in r.getMessage()]
    assert len(msgs) == 1 and "k" in msgs[0] and "checksum" in msgs[0]
    assert "launch code" not in caplog.text


def test_identity_mismatch_and_unknown_identity() -> None:
    raw = MemoryStore()
    seal_store(raw, tier="w", identity="layout-a").put("k", b"abc")
    assert seal_store(raw, tier="r", identity="layout-a").get("k") == b"abc"
    assert seal_store(raw, tier="r").get("k") == b"abc"  # a reader that knows no identity
    assert seal_store(raw, tier="r", identity="layout-b").get("k") is None
    # another layout's chunk is not damage: kept for its writer (docs/integrity.md, the delete rule)
    assert seal_store(raw, tier="w", identity="layout-a").get("k") == b"abc"


def test_scatter_writes_split_across_parts() -> None:
    a, b, c = bytearray(3), bytearray(4), bytearray(2)
    sc = Scatter(a, b, c)
    sc[2:8] = b"ABCDEF"
    assert (bytes(a), bytes(b), bytes(c)) == (b"\0\0A", b"BCDE", b"F\0")
    assert [v.nbytes for v in sc.views_from(5)] == [2, 2]
    with pytest.raises(ValueError):
        sc[0:2] = b"xyz"


def test_inspect_and_tenants() -> None:
    s, raw = sealed()
    s.put("m%2Fx@0@01@team-a", b"1234")
    assert inspect_object("m%2Fx@0@01@team-a", raw.get("m%2Fx@0@01@team-a") or b"") == ("good", None)
    assert inspect_object("other", raw.get("m%2Fx@0@01@team-a") or b"") == ("foreign", "name")
    assert inspect_object("x", b"legacy bytes") == ("legacy", "unsealed")
    assert inspect_object("x", b"KVBE" + bytes(10)) == ("foreign", "version")  # format 0: not ours
    assert inspect_object("x", b"KVBE\x01" + bytes(10)) == ("corrupt", "truncated")
    assert tenant_of_name("kv/m%2Fx@0@01@team-a") == "team-a"
    assert tenant_of_name("m@1@0@ff@bfloat16@tenant%25t1") == "t1"
    assert tenant_of_name("m@1@0@ff@bfloat16") == ""


def test_scatter_hash_follows_in_order_writes_and_voids_on_a_rewrite() -> None:
    import xxhash

    data = bytes(range(256)) * 40
    sc = Scatter(bytearray(64), bytearray(len(data) - 64), hasher=xxhash.xxh3_64(), hash_from=64)
    sc[0:1000] = data[:1000]
    sc[3000:len(data)] = data[3000:]  # out of order: not hashed yet
    sc[1000:3000] = data[1000:3000]
    assert sc.hashed == 3000 and not sc.rewritten
    sc.landed(sc.hashed, sc.nbytes)
    assert sc.hasher.intdigest() == xxhash.xxh3_64_intdigest(data[64:])
    sc[0:500] = data[:500]  # a retried transfer starts over: the running hash is void
    assert sc.rewritten
