"""Every persistent tier refuses damaged, truncated, swapped and foreign chunks (issue 12).

For each tier (LocalDiskBackend, RemoteBackend over FileStore, S3Store on SeaweedFS and
HFBucketStore on the Hub emulator, and a HybridBackend stack) and each damage (a flipped payload
byte, a flipped header byte, a truncation, two chunks' bodies swapped, another tenant's chunk
put under this name): the read is a miss and ``kvbucket_integrity_failures_total{tier,reason}``
counted it. What the bytes prove damaged is gone from that tier; an intact envelope under
another name is not damage (issue 29 item 2) and stays (docs/integrity.md, "What a reader may
delete").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend, layout_identity
from kvbucket.chunks import KVLayout
from kvbucket.envelope import HEADER_SIZE
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.metrics import integrity_failures as failures
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.refusals import removable
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.backend_tests import chunk_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=8)
FULL = LAYOUT.full_chunk_bytes


def key(i: int, tenant: str | None = None) -> CacheEngineKey:
    return CacheEngineKey("org/model", 1, 0, 1000 + i, "bfloat16", {"tenant": tenant} if tenant else None)


@dataclass
class Tier:
    backend: StorageBackend
    raw: ObjectStore  # the store under the sealing layer: what is really persisted
    label: str  # the tier label of the metric
    prefix: str = ""

    def name(self, k: CacheEngineKey) -> str:
        return key_to_name(k, self.prefix)


def _flip_payload(t: Tier, a: str, b: str) -> tuple[str, list[str]]:
    raw = bytearray(t.raw.get(a) or b"")
    raw[HEADER_SIZE + len(raw) // 3] ^= 0x01
    t.raw.put(a, raw)
    return "checksum", [a]


def _flip_header(t: Tier, a: str, b: str) -> tuple[str, list[str]]:
    raw = bytearray(t.raw.get(a) or b"")
    raw[20] ^= 0x80  # inside the payload checksum field: the header's own check catches it
    t.raw.put(a, raw)
    return "header", [a]


def _truncate(t: Tier, a: str, b: str) -> tuple[str, list[str]]:
    raw = t.raw.get(a) or b""
    t.raw.put(a, raw[: len(raw) // 2])
    return "truncated", [a]


def _swap(t: Tier, a: str, b: str) -> tuple[str, list[str]]:
    ra, rb = t.raw.get(a), t.raw.get(b)
    assert ra is not None and rb is not None
    t.raw.put_many([(a, rb), (b, ra)])
    return "name", [a, b]


def _other_tenant(t: Tier, a: str, b: str) -> tuple[str, list[str]]:
    """Tenant B's chunk (same model, layout and hash, sealed under B's name) put under A's name."""
    theirs = key_to_name(key(1, "tenant-b"), t.prefix)
    seal_store(t.raw, tier="writer-b", identity=layout_identity(LAYOUT)).put(theirs, chunk_bytes(LAYOUT, 99))
    t.raw.put(a, t.raw.get(theirs) or b"")
    return "name", [a]


DAMAGES: dict[str, Callable[[Tier, str, str], tuple[str, list[str]]]] = {
    "flip-payload": _flip_payload,
    "flip-header": _flip_header,
    "truncate": _truncate,
    "swap-bodies": _swap,
    "other-tenant": _other_tenant,
}


def _check_damage(t: Tier, damage: str) -> None:
    a_key, b_key = key(1, "tenant-a"), key(2, "tenant-a")
    t.backend.batched_put([(a_key, chunk_bytes(LAYOUT, 1)), (b_key, chunk_bytes(LAYOUT, 2))])
    t.backend.flush()
    a, b = t.name(a_key), t.name(b_key)
    assert t.raw.head(a) == FULL + HEADER_SIZE  # sealed on disk / in the bucket
    if isinstance(t.backend, HybridBackend):
        for tier in t.backend.tiers[:-1]:  # make the remote tier the one that answers
            tier.remove(a_key)
            tier.remove(b_key)
    reason, bad = DAMAGES[damage](t, a, b)
    before = failures(t.label, reason)
    buf = np.zeros(FULL, dtype=np.uint8)
    assert t.backend.get(a_key) is None
    if b in bad:
        assert t.backend.batched_get_into([b_key], [buf]) == [False]
    assert failures(t.label, reason) == before + len(bad)
    gone = removable(reason)
    for name in bad:
        assert (t.raw.head(name) is None) == gone, f"{name}: removed {not gone} from the {t.label} tier"
    assert t.backend.get_into(a_key, buf) is False
    if gone or t.label == "disk":  # the disk tier stops indexing a file it refused and kept
        assert not t.backend.contains(a_key)
    if b not in bad:
        assert bytes(t.backend.get(b_key)) == chunk_bytes(LAYOUT, 2)  # the good neighbour still loads


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Tier]:
    with LocalDiskBackend(tmp_path / "disk", 1 << 30) as b:
        yield Tier(b, FileStore(tmp_path / "disk"), "disk")


@pytest.fixture
def remote_file(tmp_path: Path) -> Iterator[Tier]:
    with RemoteBackend(FileStore(tmp_path / "remote"), LAYOUT, prefix="kv") as b:
        yield Tier(b, FileStore(tmp_path / "remote"), "remote", "kv")


@pytest.fixture
def remote_s3(seaweedfs, s3_bucket) -> Iterator[Tier]:
    store = S3Store(S3Config.parse(seaweedfs.config(s3_bucket)))
    raw = S3Store(S3Config.parse(seaweedfs.config(s3_bucket)))
    with RemoteBackend(store, LAYOUT, exists_cache_ttl_secs=0) as b, raw:
        yield Tier(b, raw, "remote")


@pytest.fixture
def remote_hf(hub_bucket) -> Iterator[Tier]:
    def open_store() -> HFBucketStore:
        return HFBucketStore(HFBucketConfig(
            bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv", token=hub_bucket.hub.write_token,
            endpoint=hub_bucket.hub.endpoint, metadata_cache_ttl_secs=0))
    with RemoteBackend(open_store(), LAYOUT, exists_cache_ttl_secs=0) as b, open_store() as raw:
        yield Tier(b, raw, "remote")


@pytest.fixture
def hybrid(tmp_path: Path) -> Iterator[Tier]:
    tiers = [LocalCPUBackend(1 << 26), LocalDiskBackend(tmp_path / "disk", 1 << 26),
             RemoteBackend(FileStore(tmp_path / "remote"), LAYOUT)]
    with HybridBackend(tiers) as b:
        yield Tier(b, FileStore(tmp_path / "remote"), "remote")


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_disk_tier(disk: Tier, damage: str) -> None:
    _check_damage(disk, damage)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_remote_file_store(remote_file: Tier, damage: str) -> None:
    _check_damage(remote_file, damage)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_remote_s3_on_seaweedfs(remote_s3: Tier, damage: str) -> None:
    _check_damage(remote_s3, damage)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_remote_hf_bucket_on_the_emulator(remote_hf: Tier, damage: str) -> None:
    _check_damage(remote_hf, damage)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_hybrid_stack(hybrid: Tier, damage: str) -> None:
    _check_damage(hybrid, damage)


def test_disk_index_rebuild_never_serves_a_truncated_file(tmp_path: Path) -> None:
    """The issue's case: after a restart the index came from file sizes and served the half."""
    k = key(5)
    with LocalDiskBackend(tmp_path, 1 << 30) as b:
        b.put(k, chunk_bytes(LAYOUT, 5))
    path = tmp_path / key_to_name(k)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    before = failures("disk", "truncated")
    with LocalDiskBackend(tmp_path, 1 << 30) as b:
        assert not b.contains(k)
        assert b.get(k) is None and b.batched_get([k]) == [None]
        assert b.used_bytes == 0
    assert not path.exists()
    assert failures("disk", "truncated") == before + 1


def test_disk_index_rebuild_drops_headerless_and_damaged_files(tmp_path: Path) -> None:
    good, short, damaged = key(1), key(2), key(3)
    with LocalDiskBackend(tmp_path, 1 << 30) as b:
        b.batched_put([(k, chunk_bytes(LAYOUT, i)) for i, k in enumerate((good, short, damaged))])
    (tmp_path / key_to_name(short)).write_bytes(b"KVBE\x01")  # an envelope of this format, cut short
    raw = bytearray((tmp_path / key_to_name(damaged)).read_bytes())
    raw[10] ^= 0xFF  # the header's length field: its check fails
    (tmp_path / key_to_name(damaged)).write_bytes(raw)
    with LocalDiskBackend(tmp_path, 1 << 30) as b:
        assert b.list() == [good.to_string()]
        assert bytes(b.get(good)) == chunk_bytes(LAYOUT, 0)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [key_to_name(good)]


def test_a_chunk_of_another_layout_is_a_miss(tmp_path: Path) -> None:
    """Same size, other dtype: the envelope's identity says it was written for another layout."""
    other = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", chunk_tokens=8)
    with RemoteBackend(FileStore(tmp_path), other) as w:
        w.put(key(1), chunk_bytes(LAYOUT, 1))
    before = failures("remote", "identity")
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as r:
        assert r.get(key(1)) is None
    assert failures("remote", "identity") == before + 1


def test_unsealed_objects_follow_the_policy(tmp_path: Path) -> None:
    """A legacy object (raw bytes, no envelope): a miss by default (kept: it may be another
    program's), served as is with unsealed='accept'."""
    FileStore(tmp_path).put(key_to_name(key(1)), chunk_bytes(LAYOUT, 1))
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as strict:
        assert strict.get(key(1)) is None
        buf = np.zeros(FULL, dtype=np.uint8)
        assert strict.get_into(key(1), buf) is False
    assert FileStore(tmp_path).exists(key_to_name(key(1)))
    with RemoteBackend(FileStore(tmp_path), LAYOUT, unsealed="accept") as lenient:
        buf = np.zeros(FULL, dtype=np.uint8)
        assert lenient.get_into(key(1), buf) is True and buf.tobytes() == chunk_bytes(LAYOUT, 1)


def test_a_flipped_byte_inside_an_emulator_xorb_is_a_miss(remote_hf: Tier, hub_bucket) -> None:
    """The issue's case: a byte flipped in the Hub's stored xorb came back as a good chunk."""
    k = key(7)
    remote_hf.backend.put(k, chunk_bytes(LAYOUT, 7))
    xorbs = sorted((hub_bucket.hub.data_dir / "xorbs").rglob("*"), key=lambda p: p.stat().st_mtime)
    xorb = [p for p in xorbs if p.is_file()][-1]  # the xorb just uploaded
    data = bytearray(xorb.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the chunk's (incompressible, stored as is) bytes
    xorb.write_bytes(data)
    before = failures("remote", "checksum")
    assert remote_hf.backend.get(k) is None
    assert failures("remote", "checksum") == before + 1
    assert remote_hf.raw.head(remote_hf.name(k)) is None
