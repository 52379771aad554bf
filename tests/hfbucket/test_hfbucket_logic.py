"""Unit tests of HFBucketStore's own logic (batching, reconciliation, cache, buffers) on an
in-memory Hub double. The real behaviour is tested on the emulator in test_hfbucket_store.py;
this file pins down the bookkeeping that is hard to provoke there (exact failure timing)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvbucket.errors import NotFoundError, SizeMismatchError, StoreError, TransientStoreError
from kvbucket.stores.hub.client import HubBucketClient, RemoteFile
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore


class FakeHub(HubBucketClient):
    """Bucket state in dicts; counts requests; failure hooks per call."""

    def __init__(self, exists: bool = True) -> None:
        super().__init__(endpoint="http://fake.invalid", bucket_id="o/b", token=None, token_source="none",
                         max_retries=0, retry_backoff_secs=0)
        self.exists = exists
        self.files: dict[str, RemoteFile] = {}
        self.blobs: dict[str, bytes] = {}
        self.calls: dict[str, int] = {}
        self.fail_paths: set[str] = set()  # commit_batch reports these as failed
        self.raise_after_apply = False  # commit_batch applies, then raises a transient error
        self.paths_info_fails = False
        self.creates = 0
        self.lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    def _need_bucket(self) -> None:
        if not self.exists:
            raise NotFoundError("bucket 'o/b' does not exist; set create_bucket_if_missing: true")

    def create_private(self, deadline: float | None = None) -> None:
        self._count("create")
        self.exists = True

    def bucket_info(self, deadline: float | None = None) -> dict[str, Any]:
        return {"private": True}

    def paths_info(self, paths: Sequence[str], deadline: float | None = None, with_mtime: bool = False
                   ) -> dict[str, RemoteFile]:  # the client's signature (the writer's re-check asks mtimes)
        for _ in range(0, max(1, len(paths)), 1000):  # the client sends one request per 1,000
            self._count("paths_info")
        self._need_bucket()
        if self.paths_info_fails:
            raise TransientStoreError("paths-info down")
        return {p: self.files[p] for p in paths if p in self.files}

    def upload(self, items: Sequence[tuple[str, Any]], deadline: float | None = None
               ) -> list[tuple[str, int]]:
        self._count("upload")
        out = []
        for _, data in items:
            b = bytes(data)
            h = hashlib.sha256(b).hexdigest()
            self.blobs[h] = b
            out.append((h, len(b)))
        return out

    def commit_batch(self, ops: Sequence[dict[str, Any]], deadline: float | None = None,
                     what: str = "commit a batch of writes") -> dict[str, str]:
        assert len(ops) <= 1000
        self._count("batch")
        self._need_bucket()
        failed = {}
        for op in ops:
            p = op["path"]
            if p in self.fail_paths:
                failed[p] = "injected failure"
                continue
            if op["type"] == "addFile":
                self.files[p] = RemoteFile(p, len(self.blobs[op["xetHash"]]), op["xetHash"])
            else:
                self.files.pop(p, None)
        if self.raise_after_apply:
            raise TransientStoreError("connection dropped after the batch was applied")
        return failed

    def download_into(self, f: RemoteFile, view: memoryview, gate: Any = None, deadline: Any = None) -> None:
        self._count("download")
        if f.xet_hash not in self.blobs:
            raise StoreError("unknown xet hash")
        view[:] = self.blobs[f.xet_hash]

    def list_tree(self, directory: str) -> Iterator[RemoteFile]:
        self._need_bucket()
        yield from sorted(self.files.values(), key=lambda f: f.path)

    def warm_reads(self) -> None:  # no read token or reconstruction on this fake
        self._count("warm_reads")

    def prefetch_reconstructions(self, files: Any, *, background: bool = False, deadline: Any = None) -> None:
        self._count("prefetch_reconstructions")

    def reset_download_group(self) -> None:
        pass


def make(prefix: str = "pfx", ttl: float = 30.0, create: bool = False, exists: bool = True
         ) -> tuple[HFBucketStore, FakeHub]:
    hub = FakeHub(exists=exists)
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/o/b/{prefix}".rstrip("/"), metadata_cache_ttl_secs=ttl,
                         create_bucket_if_missing=create)
    return HFBucketStore(cfg, client=hub), hub


def test_round_trip_under_prefix() -> None:
    store, hub = make()
    res = store.put_many([("a", b"1"), ("x/y", b"22"), ("e", b"")])
    assert [r.size for r in res] == [1, 2, 0]
    assert set(hub.files) == {"pfx/a", "pfx/x/y", "pfx/e"}
    got = store.get_many(["a", "x/y", "e", "missing"])
    assert [None if r.data is None else bytes(r.data) for r in got] == [b"1", b"22", b"", None]
    assert [o.name for o in store.list()] == ["a", "e", "x/y"]
    assert [o.name for o in store.list("x/")] == ["x/y"]
    assert [r.size for r in store.delete_many(["a", "missing"])] == [1, None]
    assert "pfx/a" not in hub.files


def test_partial_batch_reports_exactly_what_landed() -> None:
    store, hub = make()
    hub.fail_paths = {"pfx/k1", "pfx/k3"}
    res = store.put_many([(f"k{i}", bytes([i]) * 10) for i in range(5)])
    assert [r.ok for r in res] == [True, False, True, False, True]
    assert "injected failure" in str(res[1].error)
    assert [r.size for r in res] == [10, None, 10, None, 10]
    hub.fail_paths = set()
    # the cache agrees with the bucket afterwards
    assert [r.size for r in store.head_many([f"k{i}" for i in range(5)])] == [10, None, 10, None, 10]


def test_batch_applied_then_connection_lost_is_reconciled_as_stored() -> None:
    store, hub = make()
    hub.raise_after_apply = True
    res = store.put_many([("a", b"xyz"), ("b", b"q")])
    assert all(r.ok for r in res) and [r.size for r in res] == [3, 1]


def test_unverifiable_batch_is_reported_failed() -> None:
    store, hub = make()
    hub.raise_after_apply = True
    hub.paths_info_fails = True
    res = store.put_many([("a", b"xyz")])
    assert not res[0].ok and "could not be checked" in str(res[0].error)


def test_old_version_at_path_does_not_count_as_stored() -> None:
    store, hub = make()
    store.put("a", b"old")
    hub.fail_paths = {"pfx/a"}
    (r,) = store.put_many([("a", b"new!")])
    assert not r.ok
    assert store.get("a") == b"old"


def test_duplicates_in_one_put_last_wins() -> None:
    store, hub = make()
    res = store.put_many([("a", b"first"), ("a", b"second!")])
    assert [r.size for r in res] == [5, 7]
    assert store.get("a") == b"second!"
    assert hub.calls["upload"] == 1


def test_batches_of_1000_and_cache_makes_warm_lookups_free() -> None:
    store, hub = make(prefix="")
    names = [f"n{i}" for i in range(2500)]
    store.put_many([(n, b"v") for n in names])
    assert hub.calls["batch"] == 3 and hub.calls["upload"] == 3
    store2 = HFBucketStore(store.config, client=hub)  # a cold cache
    hub.calls.clear()
    assert all(r.size == 1 for r in store2.head_many(names))
    assert hub.calls["paths_info"] == 3
    assert all(r.size == 1 for r in store2.head_many(names))
    assert hub.calls["paths_info"] == 3  # warm: no request
    store2.delete_many(names[:10])
    assert [r.size for r in store2.head_many(names[:12])] == [None] * 10 + [1, 1]


def test_ttl_zero_always_asks() -> None:
    store, hub = make(ttl=0)
    store.put("a", b"1")
    hub.calls.clear()
    store.head_many(["a"])
    store.head_many(["a"])
    assert hub.calls["paths_info"] == 2


def test_buffer_size_checked_before_writing() -> None:
    store, _ = make()
    store.put_many([("a", b"abcd"), ("b", b"xy")])
    small, good = bytearray(b"...."[:3]), bytearray(2)
    res = store.get_many(["a", "b"], [small, good])
    assert isinstance(res[0].error, SizeMismatchError) and small == bytearray(b"...")
    assert res[1].ok and good == b"xy" and res[1].data is good


def test_stale_cached_hash_is_refreshed_once() -> None:
    store, hub = make()
    store.put("a", b"v1")
    # another writer replaces the object and its old content disappears
    hub.blobs.clear()
    h = hashlib.sha256(b"v2!").hexdigest()
    hub.blobs[h] = b"v2!"
    hub.files["pfx/a"] = RemoteFile("pfx/a", 3, h)
    assert store.get("a") == b"v2!"


def test_missing_bucket_is_a_clear_per_item_error() -> None:
    store, _ = make(exists=False)
    (r,) = store.head_many(["a"])
    assert isinstance(r.error, NotFoundError) and "create_bucket_if_missing" in str(r.error)
    (r,) = store.put_many([("a", b"1")])
    assert isinstance(r.error, NotFoundError)
    with pytest.raises(NotFoundError):
        list(store.list())


def test_create_if_missing_creates_once_under_concurrency() -> None:
    store, hub = make(create=True, exists=False)
    assert store.head_many(["a"])[0].size is None  # a missing bucket is just empty here
    assert list(store.list()) == []
    threads = [threading.Thread(target=store.put, args=(f"k{i}", b"1")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hub.calls["create"] == 1 and len(hub.files) == 8


def test_closed_store_raises_and_close_is_idempotent() -> None:
    store, _ = make()
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.head_many(["a"])
