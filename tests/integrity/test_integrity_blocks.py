"""Payloads of several cache-sized blocks: sealing and opening work block by block (copy or
en/decrypt, then hash, while the block is in cache). The other integrity tests use chunks smaller
than one block; these check that the blocked paths compute the same checksum and refuse damage
in any block, on plain and encrypted chunks, read whole or into a caller's buffer."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from prometheus_client import REGISTRY

from kvbucket import envelope as env
from kvbucket.encryption import BLOCK, Keyring
from kvbucket.stores.base import Scatter
from kvbucket.stores.guard.sealed import SealedStore
from kvbucket.stores.local.file import FileStore

SIZE = 2 * BLOCK + BLOCK // 2 + 7  # three blocks, the last one short and odd-sized
NAME = "m%2Fx@1@0@ab@bfloat16"
KEY_A, KEY_B = os.urandom(32), os.urandom(32)


def failures(reason: str) -> float:
    return REGISTRY.get_sample_value("kvbucket_integrity_failures_total",
                                     {"tier": "blocks", "reason": reason}) or 0.0


def payload() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)


def store(root: Path, key: bytes | None) -> SealedStore:
    ring = Keyring({"*": {1: key}}) if key is not None else None
    return SealedStore(FileStore(root), tier="blocks", keyring=ring)


@pytest.mark.parametrize("key", [None, KEY_A], ids=["plain", "aes"])
def test_multi_block_round_trip_and_checksum_is_of_stored_bytes(tmp_path: Path, key: bytes | None) -> None:
    s = store(tmp_path, key)
    data = payload()
    assert s.put_many([(NAME, data)])[0].error is None
    stored = FileStore(tmp_path).get(NAME)
    assert stored is not None
    header = env.parse_header(stored[: env.HEADER_SIZE], NAME)
    assert header.checksum == xxhash.xxh3_64_intdigest(stored[env.HEADER_SIZE :])  # what a reader checks
    assert header.payload_len == SIZE + (env.TAG_SIZE if key else 0)
    if key:
        assert bytes(data[:4096]) not in stored
    buf = np.zeros(SIZE, dtype=np.uint8)
    (r,) = s.get_many([NAME], [buf])
    assert r.found and np.array_equal(buf, data)
    (whole,) = s.get_many([NAME])
    assert bytes(whole.data) == data.tobytes()


@pytest.mark.parametrize("key", [None, KEY_A], ids=["plain", "aes"])
@pytest.mark.parametrize("block", [0, 2])
def test_damage_in_any_block_is_a_checksum_miss(tmp_path: Path, key: bytes | None, block: int) -> None:
    s = store(tmp_path, key)
    s.put_many([(NAME, payload())])
    raw = FileStore(tmp_path)
    stored = bytearray(raw.get(NAME) or b"")
    stored[env.HEADER_SIZE + block * BLOCK + 5] ^= 0x10
    raw.put(NAME, stored)
    before = failures("checksum")
    (r,) = s.get_many([NAME], [np.zeros(SIZE, dtype=np.uint8)])
    assert not r.found and r.error is None
    assert failures("checksum") == before + 1  # encrypted too: damage, not a key problem
    assert not raw.exists(NAME)


def test_another_key_is_a_decrypt_miss_into_a_buffer(tmp_path: Path) -> None:
    store(tmp_path, KEY_A).put_many([(NAME, payload())])
    before = failures("decrypt")
    (r,) = store(tmp_path, KEY_B).get_many([NAME], [np.zeros(SIZE, dtype=np.uint8)])
    assert not r.found
    assert failures("decrypt") == before + 1


def test_scatter_fast_path_falls_back_for_other_formats_and_lengths() -> None:
    data = np.arange(4096, dtype=np.int16)  # 8 KiB, exported as "h", not bytes
    body = bytearray(data.nbytes)
    sc = Scatter(bytearray(64), body, hasher=xxhash.xxh3_64(), hash_from=64)
    sc[64 : 64 + 4096] = memoryview(data)[:2048]  # an int16 view: cast by the general path
    with pytest.raises(ValueError):
        sc[64 + 4096 : 64 + 8192] = b"short"  # refused before anything is written or hashed
    assert sc.hashed == 64 + 4096
    sc[64 + 4096 : 64 + 8192] = data.tobytes()[4096:]
    assert bytes(body) == data.tobytes() and sc.hashed == sc.nbytes
    assert sc.hasher.intdigest() == xxhash.xxh3_64_intdigest(data.tobytes())


def test_encrypted_header_over_a_payload_shorter_than_a_tag_is_a_length_miss(tmp_path: Path) -> None:
    raw = FileStore(tmp_path)
    body = b"0123456789"  # 10 bytes: not even a GCM tag
    head = env.pack_header(len(body), xxhash.xxh3_64_intdigest(body), NAME, key_id=1, nonce=bytes(12))
    raw.put(NAME, head + body)
    before = failures("length")
    (r,) = store(tmp_path, KEY_A).get_many([NAME])
    assert not r.found and r.error is None
    assert failures("length") == before + 1 and not raw.exists(NAME)
