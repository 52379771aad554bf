"""Fences of the directory tiers: no verb of FileStore or LocalDiskBackend reaches outside the root.

A symlink planted inside a store (by another user of a shared cache directory, or a mistake)
is never followed, wherever it sits in a name: a leading directory, the last component, the
temp directory, the disk tier's lock file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from kvbucket.backends.local_disk import LOCK_NAME, LocalDiskBackend
from kvbucket.errors import ConfigError, StoreError
from kvbucket.stores.local.file import TMP_DIR_NAME, FileStore


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "x").write_bytes(b"secret")
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("where", ["link", "a/link", "a/b/link"])
def test_a_symlinked_directory_inside_the_store_is_never_followed(
    tmp_path: Path, outside: Path, where: str
) -> None:
    root = tmp_path / "store"
    store = FileStore(root)
    store.put("a/b/keep", b"k")  # real directories on the way
    (root / where).symlink_to(outside, target_is_directory=True)
    name = f"{where}/x"
    before = _snapshot(outside)

    assert store.get(name) is None, "a read through the link reached outside the store"
    assert store.get_many([name], [bytearray(6)])[0].found is False
    assert store.head(name) is None
    assert store.exists(name) is False
    (d,) = store.delete_many([name])
    assert d.ok and d.size is None
    assert [i.name for i in store.list()] == ["a/b/keep"]
    assert list(store.list(f"{where}/")) == []

    results = store.put_many([(name, b"overwrite"), (f"{where}/new", b"planted"), ("fine", b"1")])
    assert not results[0].ok and not results[1].ok, "a put through the link must fail"
    assert "symlink" in str(results[0].error) and "never follows" in str(results[0].error)
    assert results[2].ok and store.get("fine") == b"1", "other items of the batch are written"
    assert _snapshot(outside) == before, "nothing outside the store was read, written or deleted"
    assert (root / where).is_symlink(), "the link itself is left alone"
    assert sorted(os.listdir(root / TMP_DIR_NAME)) == [], "failed puts leave no temp file"


def test_a_symlinked_object_is_not_an_object(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "store"
    store = FileStore(root)
    (root / "d").mkdir()
    (root / "d" / "leaf").symlink_to(outside / "x")
    assert store.get("d/leaf") is None and store.head("d/leaf") is None
    store.delete("d/leaf")
    assert (outside / "x").read_bytes() == b"secret"
    store.put("d/leaf", b"new")  # replaces the link itself, never writes through it
    assert not (root / "d" / "leaf").is_symlink() and store.get("d/leaf") == b"new"
    assert (outside / "x").read_bytes() == b"secret"


def test_a_symlinked_temp_dir_is_neither_swept_nor_written(tmp_path: Path, outside: Path) -> None:
    old = time.time() - 3600
    os.utime(outside / "x", (old, old))  # looks like a stale temp file of a crashed writer
    root = tmp_path / "store"
    root.mkdir()
    (root / TMP_DIR_NAME).symlink_to(outside, target_is_directory=True)
    store = FileStore(root, stale_tmp_secs=1)  # opening sweeps stale temp files: not through a link
    assert store.sweep_stale_temp_files(-1) == 0
    with pytest.raises(StoreError, match=TMP_DIR_NAME):
        store.put("y", b"data")
    assert _snapshot(outside) == {"x": b"secret"}


def test_disk_tier_never_follows_links_in_its_directory(tmp_path: Path, outside: Path) -> None:
    d = tmp_path / "disk"
    d.mkdir()
    (d / LOCK_NAME).symlink_to(outside / "planted-lock")
    with pytest.raises(ConfigError, match="symlink"):
        LocalDiskBackend(d, 1 << 20)
    assert not (outside / "planted-lock").exists(), "the lock file was created through the link"
    (d / LOCK_NAME).unlink()

    (d / TMP_DIR_NAME).symlink_to(outside, target_is_directory=True)
    disk = LocalDiskBackend(d, 1 << 20)
    try:
        with pytest.raises(StoreError, match=TMP_DIR_NAME):
            disk.put("k1", b"chunk")
        assert disk.get("k1") is None and disk.used_bytes == 0
    finally:
        disk.close()
    assert _snapshot(outside) == {"x": b"secret"}


def test_a_root_removed_and_recreated_behind_the_store_is_followed_by_path(tmp_path: Path) -> None:
    """The root's fd is kept open between calls; a root replaced since is reopened, never written
    into the removed directory (where puts would vanish)."""
    root = tmp_path / "store"
    store = FileStore(root)
    store.put("a", b"1")
    shutil.rmtree(root)
    root.mkdir()
    assert store.get("a") is None and store.head("a") is None
    store.put("nested/b", b"2")
    assert (root / "nested" / "b").read_bytes() == b"2" and store.get("nested/b") == b"2"
    assert [i.name for i in store.list()] == ["nested/b"]


def test_a_key_that_is_not_valid_utf8_fails_alone_in_a_backend_batch() -> None:
    """At the chunk level a bad key is that item's error; the others land, nothing half-written."""
    import numpy as np

    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.chunks import KVLayout
    from kvbucket.errors import InvalidKeyError
    from kvbucket.stores.local.memory import MemoryStore

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float16", chunk_tokens=4)
    store = MemoryStore()
    with RemoteBackend(store, layout) as b:
        full = np.ones(layout.full_chunk_bytes, np.uint8)
        out = b.batched_put_results([("good", full), ("bad\ud800", full), ("also-good", full)])
        assert out[0] is None and out[2] is None
        assert isinstance(out[1], InvalidKeyError) and "UTF-8" in str(out[1])
        assert sorted(b.list()) == ["also-good", "good"]
        assert len(list(store.list())) == 2
