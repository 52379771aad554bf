"""The one rule of what a reader may delete (docs/integrity.md, issue 24 item 5).

A reader that cannot open a chunk (no keyring, only another tenant's key, another key under the
same id, a retired key, another KV layout) gets a miss, counted per reason, and the chunk stays
loadable by its writer: over a directory, S3 (SeaweedFS) and a Hub bucket (the emulator).
Damage (a flipped byte, a truncation) is still removed: tests/integrity/test_integrity_tiers.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.encryption import Keyring
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.metrics import integrity_failures as failures
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.refusals import DAMAGE, UNREADABLE, removable
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import chunk_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=8)
OTHER = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", chunk_tokens=8)
KEYS = {name: os.urandom(32) for name in ("a1", "a2", "b1")}
WRITER_RING = {"a": {1: "a1"}}

#: reader -> (its layout, its keyring (tenant -> key id -> key), the reason it is refused)
READERS: dict[str, tuple[KVLayout, dict[str, dict[int, str]] | None, str]] = {
    "no-keyring": (LAYOUT, None, "no_keyring"),
    "only-tenant-b": (LAYOUT, {"b": {1: "b1"}}, "key"),
    "tenant-b-key-as-a": (LAYOUT, {"a": {1: "b1"}}, "decrypt"),
    "retired-key": (LAYOUT, {"a": {2: "a2"}}, "key"),  # key 1 retired from this reader's ring
    "other-layout": (LAYOUT, WRITER_RING, "identity"),  # written by a float16 writer (OTHER)
}


def ring(tenants: dict[str, dict[int, str]] | None) -> Keyring | None:
    if tenants is None:
        return None
    return Keyring({t: {kid: KEYS[k] for kid, k in ids.items()} for t, ids in tenants.items()})


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("org/model", 1, 0, 4000 + i, "bfloat16", {"tenant": "a"})


@pytest.mark.parametrize("reader", list(READERS))
def test_a_reader_that_cannot_open_a_chunk_leaves_it_to_its_writer(
    open_store: Callable[[], ObjectStore], reader: str
) -> None:
    layout, tenants, reason = READERS[reader]
    writer_layout = OTHER if reader == "other-layout" else LAYOUT
    keys = [key(i) for i in range(3)]
    with RemoteBackend(open_store(), writer_layout, encryption=ring(WRITER_RING)) as w:
        w.batched_put([(k, chunk_bytes(LAYOUT, i)) for i, k in enumerate(keys)])
        w.flush()
    before = failures("remote", reason)
    with RemoteBackend(open_store(), layout, encryption=ring(tenants), exists_cache_ttl_secs=0) as r:
        assert r.get(keys[0]) is None  # read whole
        bufs = [np.zeros(LAYOUT.full_chunk_bytes, dtype=np.uint8) for _ in keys[1:]]
        assert r.batched_get_into(keys[1:], bufs) == [False, False]  # read into the caller's buffers
    assert failures("remote", reason) == before + 3
    with open_store() as raw:
        assert all(raw.head(key_to_name(k)) is not None for k in keys)
    with RemoteBackend(open_store(), writer_layout, encryption=ring(WRITER_RING)) as w:
        assert [bytes(c) for c in w.batched_get(keys)] == [chunk_bytes(LAYOUT, i) for i in range(3)]


def test_damage_is_removed_and_a_chunk_another_reader_may_open_is_kept() -> None:
    """The rule itself: removable reasons are exactly the damage ones."""
    assert {"checksum", "truncated", "length", "header"} == DAMAGE
    assert {"name", "no_keyring", "key", "decrypt", "identity", "plaintext", "lmcache", "unsealed",
            "version"} == UNREADABLE
    assert all(removable(r) for r in DAMAGE) and not any(removable(r) for r in UNREADABLE)


def test_a_plaintext_chunk_read_with_encryption_on_is_kept(tmp_path: Path) -> None:
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as plain:
        plain.put(key(1), chunk_bytes(LAYOUT, 1))
    before = failures("remote", "plaintext")
    with RemoteBackend(FileStore(tmp_path), LAYOUT, encryption=ring(WRITER_RING)) as enc:
        assert enc.get(key(1)) is None
    assert failures("remote", "plaintext") == before + 1
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as plain:
        assert bytes(plain.get(key(1))) == chunk_bytes(LAYOUT, 1)


def test_the_disk_tier_keeps_what_it_cannot_open_and_evicts_it_first(tmp_path: Path) -> None:
    """Issue 29 item 2: the disk tier's directory removed every file it could not open (its
    'private' exception), so a restart with encryption turned on, or another keyring, erased the
    cache. Such a file is now a miss that stays, counts in the byte bound, and goes first when
    room is needed; a damaged one is still removed."""
    from kvbucket.backends.local_disk import LocalDiskBackend

    chunk = len(chunk_bytes(LAYOUT, 1))
    bound = 3 * chunk + 100  # room for three chunks (and the encrypted ones' tags)
    with LocalDiskBackend(tmp_path, bound, encryption=ring(WRITER_RING)) as enc:
        enc.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in (1, 2)])
    paths = [tmp_path / key_to_name(key(i)) for i in (1, 2)]
    before = failures("disk", "no_keyring")
    with LocalDiskBackend(tmp_path, bound) as plain:  # the index rebuild reads the headers
        assert plain.get(key(1)) is None and not plain.contains(key(2))
        assert all(p.exists() for p in paths)  # not for this tier, not removed
        assert failures("disk", "no_keyring") == before + 2
        assert plain.used_bytes >= 2 * chunk  # they count in the bound ...
        plain.put(key(3), chunk_bytes(LAYOUT, 3))
        plain.put(key(4), chunk_bytes(LAYOUT, 4))  # ... and make room first, oldest first
        assert not paths[0].exists() and paths[1].exists()
        assert bytes(plain.get(key(3))) == chunk_bytes(LAYOUT, 3) and plain.contains(key(4))
    with LocalDiskBackend(tmp_path, bound, encryption=ring(WRITER_RING)) as enc:
        assert bytes(enc.get(key(2))) == chunk_bytes(LAYOUT, 2)  # its writer still reads it


def _keyring_file(tmp_path: Path) -> str:
    import base64
    import json

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"*": {"1": base64.b64encode(KEYS["a1"]).decode()}}}))
    return str(path)


@pytest.mark.parametrize("policy", ["miss", "accept"])
def test_a_plaintext_object_under_lmcaches_fs_name_is_not_served_with_encryption_on(
    tmp_path: Path, policy: str
) -> None:
    """Issue 24 item 4: with encryption on, LMCache's raw format was served as a hit."""
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import open_l2_adapter
    from kvbucket.l2.naming import Naming
    from kvbucket.testing import l2 as t

    k = ObjectKey("org/model", 0, b"\x05" * 16, "t1")
    lm_name = Naming(style="fs").lmcache_name(k)
    assert lm_name is not None
    planted = bytes(range(256)) * 8
    FileStore(tmp_path / "l2").put(lm_name, planted)
    spec = {"type": "fs", "base_path": str(tmp_path / "l2"), "unsealed": policy,
            "encryption": {"keyring_file": _keyring_file(tmp_path)}}
    before = failures("l2", "lmcache")
    with open_l2_adapter(spec) as a:
        buf = bytearray(len(planted))
        if policy == "accept":  # the operator's choice: unenveloped objects are served
            assert t.lookup(a, [k]) == [True]
            assert t.load(a, [k], [buf]) == [True] and bytes(buf) == planted
            return
        assert t.lookup(a, [k]) == [False]
        assert t.load(a, [k], [buf]) == [False] and bytes(buf) != planted
        assert a._store.get_many([lm_name])[0].size is None  # a load by that name: refused too
    assert failures("l2", "lmcache") == before + 2  # the adapter's load tried LMCache's name, then ours
    assert FileStore(tmp_path / "l2").get(lm_name) == planted  # not damage: left in place


def test_writing_lmcaches_format_with_encryption_on_is_refused(tmp_path: Path) -> None:
    from kvbucket.errors import ConfigError
    from kvbucket.l2 import open_l2_adapter

    spec = {"type": "fs", "base_path": str(tmp_path / "l2"), "object_format": "lmcache",
            "encryption": {"keyring_file": _keyring_file(tmp_path)}}
    with pytest.raises(ConfigError, match="cannot be encrypted"):
        open_l2_adapter(spec)


def test_a_fleet_node_that_cannot_open_a_chunk_does_not_report_it_deleted(tmp_path: Path) -> None:
    """The L2 load path told the fleet of a deletion on every miss of an indexed chunk: a node
    without a keyring would have dropped the writer's chunks from every node's view."""
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.l2 import ObjectStoreL2Adapter
    from kvbucket.stores.local.memory import MemoryStore
    from kvbucket.testing import l2 as t
    from kvbucket.testing.fleet_node import chunk, until
    from kvbucket.testing.fleet_node import key as l2_key

    fast = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 0.5,
            "grace_secs": 0.0}
    size = 1024
    shared = MemoryStore("fleet")

    def node(name: str, encryption: Keyring | None) -> ObjectStoreL2Adapter:
        return ObjectStoreL2Adapter(shared, owns_store=False, full_chunk_bytes=size, encryption=encryption,
                                    fleet=FleetConfig(node_id=name, **fast))

    a = node("a", Keyring({"*": {1: KEYS["a1"]}}))
    b = node("b", None)  # no keyring
    try:
        assert a.wait_until_rebuilt(10) and b.wait_until_rebuilt(10)
        keys = [l2_key(i) for i in range(3)]
        assert t.store(a, keys, [chunk(i, size) for i in range(3)]).success
        assert until(lambda: b.get_usage().bytes_used == 3 * size)
        before = failures("l2", "no_keyring")
        assert t.load(b, keys, [bytearray(size) for _ in keys]) == [False] * 3
        assert failures("l2", "no_keyring") == before + 3
        fleet = b.report_status()["fleet"]
        assert (fleet["chunks"], fleet["bytes_used"]) == (3, 3 * size)  # the fleet's view still holds them
        bufs = [bytearray(size) for _ in keys]
        assert t.load(a, keys, bufs) == [True] * 3 and bufs[2] == chunk(2, size)
    finally:
        a.close()
        b.close()


def test_the_non_mp_connectors_lmcache_names_are_not_served_with_encryption_on(tmp_path: Path) -> None:
    """The connector routes names through the same FormatStore (kvbucket.l2.format_store)."""
    from kvbucket.l2.format_store import route_formats
    from kvbucket.l2.naming import Naming
    from kvbucket.stores.guard.sealed import seal_store

    naming = Naming(style="s3", connector=True)
    k = key(1).to_string()
    lm_name = naming.lmcache_name(k)
    assert lm_name is not None and lm_name in naming.read_names(k)
    raw = FileStore(tmp_path)
    raw.put(lm_name, chunk_bytes(LAYOUT, 1))
    plain = route_formats(seal_store(raw, tier="connector"), naming)
    assert plain.get_many([lm_name])[0].found  # encryption off: LMCache's bytes, as LMCache reads them
    enc = route_formats(seal_store(raw, tier="connector", encryption=ring(WRITER_RING)), naming)
    before = failures("connector", "lmcache")
    assert enc.head_many([lm_name])[0].size is None and list(enc.list()) == []
    assert not enc.get_many([lm_name])[0].found
    assert failures("connector", "lmcache") == before + 1 and raw.exists(lm_name)
