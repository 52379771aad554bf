"""Encryption at rest (AES-256-GCM per tenant): round trips, wrong keys, rotation, no key leaks."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest

from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig, build_backend
from kvbucket.encryption import Keyring
from kvbucket.envelope import HEADER_SIZE, TAG_SIZE, parse_header
from kvbucket.errors import ConfigError
from kvbucket.keys import CacheEngineKey, ObjectKey, key_to_name
from kvbucket.l2 import open_l2_adapter
from kvbucket.metrics import integrity_failures
from kvbucket.stores.local.file import FileStore
from kvbucket.testing import l2 as t
from kvbucket.testing.backend_tests import chunk_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=8)
FULL = LAYOUT.full_chunk_bytes
KEYS = {name: os.urandom(32) for name in ("a1", "a2", "b1", "star")}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def ring(**tenants: dict[int, str]) -> Keyring:
    return Keyring({t: {kid: KEYS[k] for kid, k in ids.items()} for t, ids in tenants.items()})


def key(i: int, tenant: str) -> CacheEngineKey:
    return CacheEngineKey("org/model", 1, 0, i, "bfloat16", {"tenant": tenant})


def failures(reason: str) -> float:
    return integrity_failures("remote", reason)


def test_round_trip_per_tenant_and_ciphertext_at_rest(tmp_path: Path) -> None:
    kr = ring(a={1: "a1"}, b={1: "b1"})
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=kr) as be:
        be.batched_put([(key(1, "a"), chunk_bytes(LAYOUT, 1)), (key(2, "b"), chunk_bytes(LAYOUT, 2))])
        assert bytes(be.get(key(1, "a"))) == chunk_bytes(LAYOUT, 1)
        buf = np.empty(FULL, dtype=np.uint8)
        assert be.get_into(key(2, "b"), buf) and buf.tobytes() == chunk_bytes(LAYOUT, 2)
        assert be.contains(key(1, "a"))
    raw = FileStore(tmp_path).get(key_to_name(key(1, "a")))
    assert raw is not None and len(raw) == HEADER_SIZE + FULL + TAG_SIZE
    assert chunk_bytes(LAYOUT, 1)[:64] not in raw  # ciphertext, not the chunk
    assert parse_header(raw[:HEADER_SIZE], key_to_name(key(1, "a"))).key_id == 1


def test_wrong_tenant_key_is_a_miss_not_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={1: "a1"})) as writer:
        writer.batched_put([(key(i, "a"), chunk_bytes(LAYOUT, i)) for i in range(3)])
    before = failures("decrypt")
    # the same key id, another key: what a reader holding tenant B's key as "a" would see
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={1: "b1"})) as reader, \
            caplog.at_level(logging.WARNING):
        assert reader.batched_get([key(i, "a") for i in range(3)]) == [None, None, None]
    assert failures("decrypt") == before + 3
    assert all(r.levelno <= logging.WARNING for r in caplog.records)
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={1: "a1"})) as writer:
        # not damage: kept for the tenant whose key opens it (docs/integrity.md, the delete rule)
        assert bytes(writer.get(key(0, "a"))) == chunk_bytes(LAYOUT, 0)


def test_other_tenants_chunk_under_this_name_is_a_miss(tmp_path: Path) -> None:
    kr = ring(a={1: "a1"}, b={1: "b1"})
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=kr) as be:
        be.put(key(1, "b"), chunk_bytes(LAYOUT, 9))
        raw = FileStore(tmp_path)
        raw.put(key_to_name(key(1, "a")), raw.get(key_to_name(key(1, "b"))) or b"")
        before = failures("name")
        assert be.get(key(1, "a")) is None
        assert failures("name") == before + 1


def test_rotation_newest_key_writes_older_keys_read_while_in_the_ring(tmp_path: Path) -> None:
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={1: "a1"})) as old:
        old.put(key(1, "a"), chunk_bytes(LAYOUT, 1))
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={1: "a1", 2: "a2"})) as rotated:
        assert bytes(rotated.get(key(1, "a"))) == chunk_bytes(LAYOUT, 1)  # key 1 still reads
        rotated.put(key(2, "a"), chunk_bytes(LAYOUT, 2))
    raw = FileStore(tmp_path).get(key_to_name(key(2, "a"))) or b""
    assert parse_header(raw[:HEADER_SIZE], key_to_name(key(2, "a"))).key_id == 2
    before = failures("key")
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(a={2: "a2"})) as retired:
        assert bytes(retired.get(key(2, "a"))) == chunk_bytes(LAYOUT, 2)
        assert retired.get(key(1, "a")) is None  # key 1 left the ring
    assert failures("key") == before + 1


def test_star_key_serves_tenants_without_their_own(tmp_path: Path) -> None:
    with LocalDiskBackend(tmp_path, 1 << 20, encryption=ring(**{"*": {1: "star"}})) as disk:
        disk.put(key(1, "anyone"), chunk_bytes(LAYOUT, 1))
        disk.put(CacheEngineKey("org/model", 1, 0, 5, "bfloat16"), chunk_bytes(LAYOUT, 5))
        assert bytes(disk.get(key(1, "anyone"))) == chunk_bytes(LAYOUT, 1)
    with LocalDiskBackend(tmp_path, 1 << 20) as plain:  # encryption off: sealed-encrypted is a miss
        assert plain.get(key(1, "anyone")) is None


def test_engine_config_and_l2_json_take_the_setting(tmp_path: Path) -> None:
    keyring = tmp_path / "keys.json"
    keyring.write_text(json.dumps({"tenants": {"t1": {"1": b64(KEYS["a1"])}, "*": {"1": b64(KEYS["star"])}}}))
    cfg = EngineConfig.from_dict({"chunk_size": 8, "local_cpu": False, "remote_url": f"file://{tmp_path}/r",
                                  "extra_config": {"encryption": {"keyring_file": str(keyring)}}})
    with build_backend(cfg, LAYOUT) as be:
        be.put(key(1, "t1"), chunk_bytes(LAYOUT, 1))
        assert bytes(be.get(key(1, "t1"))) == chunk_bytes(LAYOUT, 1)
    stored = FileStore(tmp_path / "r").get(key_to_name(key(1, "t1"))) or b""
    assert len(stored) == HEADER_SIZE + FULL + TAG_SIZE

    spec = {"type": "fs", "base_path": str(tmp_path / "l2"), "encryption": {"keyring_file": str(keyring)}}
    k = ObjectKey("org/model", 0, b"\x01" * 16, "t1")
    with open_l2_adapter(spec) as a:
        assert t.store(a, [k], [bytes(range(256)) * 8]).success
        buf = bytearray(2048)
        assert t.load(a, [k], [buf]) == [True] and bytes(buf) == bytes(range(256)) * 8
    with open_l2_adapter({"type": "fs", "base_path": str(tmp_path / "l2")}) as plain:
        assert t.load(plain, [k], [bytearray(2048)]) == [False]


def test_bad_settings_are_clear_errors_without_key_material(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVBUCKET_KEYRING", raising=False)
    monkeypatch.delenv("KVBUCKET_ENCRYPTION_KEY", raising=False)
    with pytest.raises(ConfigError, match="no keyring was found"):
        Keyring.from_setting(True)
    short = b64(os.urandom(16))
    monkeypatch.setenv("KVBUCKET_ENCRYPTION_KEY", short)
    with pytest.raises(ConfigError, match="32 bytes") as info:
        Keyring.from_setting(True)
    assert short not in str(info.value)
    bad = tmp_path / "k.json"
    bad.write_text(json.dumps({"tenants": {"a": {"x": b64(KEYS["a1"])}}}))
    with pytest.raises(ConfigError, match="not an integer") as info:
        Keyring.from_file(bad)
    assert b64(KEYS["a1"]) not in str(info.value)
    with pytest.raises(ConfigError, match="encryption takes"):
        EngineConfig.from_dict({"extra_config": {"encryption": {"keyring": "x"}}})


def test_no_key_material_in_logs_reprs_errors_or_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = [KEYS[k] for k in KEYS]
    forms = [s for raw in secrets for s in (raw.hex(), b64(raw), repr(raw))]
    tenants = {"a": {"1": b64(KEYS["a1"]), "2": b64(KEYS["a2"])}, "*": {"1": b64(KEYS["star"])}}
    monkeypatch.setenv("KVBUCKET_KEYRING", json.dumps({"tenants": tenants}))
    shown: list[str] = []
    with caplog.at_level(logging.DEBUG):
        kr = Keyring.from_setting(True)
        assert kr is not None
        shown += [repr(kr), str(kr)]
        with pytest.raises(TypeError):
            import pickle

            pickle.dumps(kr)
        cfg = EngineConfig.from_dict({
            "chunk_size": 8, "local_disk": str(tmp_path / "d"), "max_local_disk_size": 1,
            "remote_url": f"file://{tmp_path}/r", "extra_config": {"encryption": True},
        })
        shown += [repr(cfg), str(cfg.redacted())]
        with build_backend(cfg, LAYOUT) as be:
            shown.append(repr(be))
            be.batched_put([(key(i, "a"), chunk_bytes(LAYOUT, i)) for i in range(4)])
            be.flush()
            assert bytes(be.get(key(1, "a"))) == chunk_bytes(LAYOUT, 1)
        with RemoteBackend(FileStore(tmp_path / "r"), LAYOUT, encryption=ring(a={1: "b1", 2: "b1"})) as wrong:
            assert wrong.batched_get([key(i, "a") for i in range(4)]) == [None] * 4  # failures logged
    text = "\n".join(shown + [r.getMessage() for r in caplog.records] + [generate_latest(REGISTRY).decode()])
    assert caplog.records, "expected log records at DEBUG"
    for form in forms:
        assert form not in text
