"""Local-file loads: encrypted objects of a batch are read one by one into a reused scratch
buffer and decrypted from it into each caller's buffer (``FileStore.get_each``), and plain ones
are read in cache-sized steps hashed as they land. Every object must still get its own bytes,
and a damaged or foreign one in the middle of a batch must be a miss without touching its
neighbours."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvbucket import envelope as env
from kvbucket.encryption import HANDOFF_MIN, Handoff, Keyring
from kvbucket.stores.base import ItemResult
from kvbucket.stores.guard import decrypting_reads
from kvbucket.stores.guard.sealed import SealedStore
from kvbucket.stores.local.file import HASH_STEP, FileStore

KEY_A, KEY_B = os.urandom(32), os.urandom(32)
# Sizes around the read step and the GCM block size, a tiny one and an empty one.
SIZES = [3 * HASH_STEP + 5, 1, HASH_STEP // 2 + 3, 0, HASH_STEP * 3 // 2 + 1, 17]


def failures(reason: str) -> float:
    return REGISTRY.get_sample_value("kvbucket_integrity_failures_total",
                                     {"tier": "local", "reason": reason}) or 0.0


def name(i: int) -> str:
    return f"m%2Fx@1@0@{i:x}@bfloat16"


def payloads() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]


def sealed(root: Path, key: bytes | None) -> SealedStore:
    return SealedStore(FileStore(root), tier="local", keyring=Keyring({"*": {1: key}}) if key else None)


@pytest.mark.parametrize("key", [None, KEY_A], ids=["plain", "aes"])
def test_a_batch_of_mixed_sizes_gets_each_objects_own_bytes(tmp_path: Path, key: bytes | None) -> None:
    s = sealed(tmp_path, key)
    data = payloads()
    assert all(r.error is None for r in s.put_many([(name(i), d) for i, d in enumerate(data)]))
    bufs = [np.full(len(d), 0xAA, dtype=np.uint8) for d in data]
    out: list[np.ndarray | None] = list(bufs)
    out[2] = None  # no buffer for this one: returned whole, in the same batch
    results = s.get_many([name(i) for i in range(len(data))], out)
    assert [r.found for r in results] == [True] * len(data)
    for i, (r, d) in enumerate(zip(results, data, strict=True)):
        got = bytes(r.data) if i == 2 else bufs[i].tobytes()
        assert got == d.tobytes(), f"object {i} ({len(d)} bytes) came back with other bytes"
        assert r.size == len(d)


@pytest.mark.parametrize("key", [None, KEY_A], ids=["plain", "aes"])
def test_damage_in_the_middle_of_a_batch_is_one_miss(tmp_path: Path, key: bytes | None) -> None:
    s = sealed(tmp_path, key)
    data = payloads()
    s.put_many([(name(i), d) for i, d in enumerate(data)])
    raw = FileStore(tmp_path)
    stored = bytearray(raw.get(name(0)) or b"")
    stored[env.HEADER_SIZE + 2 * HASH_STEP + 1] ^= 0x01  # inside the third read step
    raw.put(name(0), stored)
    bufs = [np.zeros(len(d), dtype=np.uint8) for d in data]
    before = failures("checksum")
    results = s.get_many([name(i) for i in range(len(data))], bufs)
    assert [r.found for r in results] == [False] + [True] * (len(data) - 1)
    assert results[0].error is None  # a miss, not an error
    assert failures("checksum") == before + 1  # encrypted too: damage, not a key problem
    assert not raw.exists(name(0))
    for buf, d in zip(bufs[1:], data[1:], strict=True):
        assert buf.tobytes() == d.tobytes()


def test_a_foreign_key_in_the_middle_of_a_batch_is_a_decrypt_miss(tmp_path: Path) -> None:
    data = payloads()
    sealed(tmp_path, KEY_A).put_many([(name(i), d) for i, d in enumerate(data)])
    sealed(tmp_path, KEY_B).put_many([(name(1), data[1])])  # another tenant's chunk under this name
    bufs = [np.zeros(len(d), dtype=np.uint8) for d in data]
    before = failures("decrypt")
    results = sealed(tmp_path, KEY_A).get_many([name(i) for i in range(len(data))], bufs)
    assert [r.found for r in results] == [True, False] + [True] * (len(data) - 2)
    assert failures("decrypt") == before + 1
    assert bufs[4].tobytes() == data[4].tobytes()


def test_encrypted_object_of_another_size_than_the_buffer_is_kept_and_reported(tmp_path: Path) -> None:
    s = sealed(tmp_path, KEY_A)
    data = payloads()
    s.put_many([(name(0), data[0])])
    (r,) = s.get_many([name(0)], [np.zeros(len(data[0]) + 1, dtype=np.uint8)])
    assert not r.found and r.error is not None and "bytes" in str(r.error)
    assert FileStore(tmp_path).exists(name(0))  # a good chunk of another size is not damage


def test_get_each_hands_over_each_object_before_reading_the_next(tmp_path: Path) -> None:
    raw = FileStore(tmp_path)
    blobs = [bytes([i]) * 1000 for i in range(4)]
    raw.put_many([(name(i), b) for i, b in enumerate(blobs)])
    shared = bytearray(1000)  # every object is read into the same memory
    seen: list[bytes] = []

    def after(i: int, r: ItemResult) -> ItemResult:
        seen.append(bytes(shared))
        return ItemResult(r.name, size=r.size, data=i)

    results = raw.get_each([name(i) for i in range(4)], [shared] * 4, after)
    assert seen == blobs
    assert [r.data for r in results] == [0, 1, 2, 3]


BIG = [HANDOFF_MIN + 3, HANDOFF_MIN, HANDOFF_MIN + 5, HANDOFF_MIN + 1, HANDOFF_MIN]


@pytest.mark.parametrize("spare", [True, False], ids=["handed-off", "in-line"])
def test_large_encrypted_objects_decrypted_while_the_next_is_read(tmp_path: Path, spare: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Large objects alternate between two scratch buffers and are decrypted by a helper thread
    # while the next one is read: every buffer still gets its own bytes, and a damaged object
    # and a foreign one (their failures raised on the helper) are misses for the right reason.
    monkeypatch.setattr(decrypting_reads, "spare_cores", lambda: spare)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in BIG]
    sealed(tmp_path, KEY_A).put_many([(name(i), d) for i, d in enumerate(data)])
    sealed(tmp_path, KEY_B).put_many([(name(3), data[3])])
    raw = FileStore(tmp_path)
    stored = bytearray(raw.get(name(2)) or b"")
    stored[-env.TAG_SIZE - 9] ^= 0x80  # near the end: found only by the whole-object check
    raw.put(name(2), stored)
    bufs = [np.zeros(len(d), dtype=np.uint8) for d in data]
    checksum, decrypt = failures("checksum"), failures("decrypt")
    results = sealed(tmp_path, KEY_A).get_many([name(i) for i in range(len(data))], bufs)
    assert [r.found for r in results] == [True, True, False, False, True]
    assert results[2].error is None and results[3].error is None
    assert (failures("checksum"), failures("decrypt")) == (checksum + 1, decrypt + 1)
    assert not raw.exists(name(2)) and raw.exists(name(3))  # damage removed, another key's kept
    for i in (0, 1, 4):
        assert bufs[i].tobytes() == data[i].tobytes()


def test_handoff_runs_the_call_once_here_or_on_the_helper() -> None:
    for _ in range(50):
        ran: list[str] = []
        handoff = Handoff(lambda ran=ran: ran.append(threading.current_thread().name))
        here = handoff.finish()
        assert len(ran) == 1  # exactly once, and done when finish returns
        assert here == (ran[0] == threading.current_thread().name)

    def fail() -> None:
        raise env.EnvelopeError("decrypt", "x: refused")

    with pytest.raises(env.EnvelopeError):
        Handoff(fail).finish()  # raised where it ran, re-raised here either way
