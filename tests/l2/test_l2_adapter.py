"""The L2 interface over MemoryStore and FileStore: semantics, fds, locks, close, accounting."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvbucket.keys import ObjectKey, key_to_name
from kvbucket.l2 import EvictionConfig, ObjectStoreL2Adapter
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing import l2 as t

CHUNK = 4096


def k(i: int, salt: str = "", model: str = "org/model-a") -> ObjectKey:
    return ObjectKey(model, 0x01000100, i.to_bytes(8, "big"), salt)


def chunk(i: int, size: int = CHUNK) -> bytes:
    return bytes([i % 251]) * size


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator:
    s = MemoryStore("l2") if request.param == "memory" else FileStore(tmp_path / "kv")
    yield s
    s.close()


@pytest.fixture
def adapter(store) -> Iterator[ObjectStoreL2Adapter]:
    a = ObjectStoreL2Adapter(store, num_workers=3, owns_store=False, full_chunk_bytes=CHUNK)
    assert a.wait_until_rebuilt(10)
    yield a
    a.close()


def test_store_lookup_load_round_trip(adapter: ObjectStoreL2Adapter) -> None:
    keys = [k(i) for i in range(10)]
    res = t.store(adapter, keys, [chunk(i) for i in range(10)])
    assert res.success and res.bytes_stored == 10 * CHUNK and all(res.landed)
    hits = t.lookup(adapter, [*keys, k(99)])
    assert hits == [True] * 10 + [False]
    bufs = [bytearray(CHUNK) for _ in range(11)]
    ok = t.load(adapter, [*keys, k(99)], bufs)
    assert ok == [True] * 10 + [False]
    assert all(bufs[i] == chunk(i) for i in range(10))
    assert bufs[10] == bytearray(CHUNK)
    assert adapter.get_usage().bytes_used == 10 * CHUNK


def test_three_distinct_event_fds_each_signalled_by_its_own_op(adapter: ObjectStoreL2Adapter) -> None:
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    tid = adapter.submit_store_task([k(1)], [chunk(1)])
    assert t.wait_fd(adapter.get_store_event_fd(), 10)
    assert not t.fd_ready(adapter.get_lookup_and_lock_event_fd())
    assert not t.fd_ready(adapter.get_load_event_fd())
    assert adapter.pop_completed_store_tasks()[tid].success
    assert adapter.pop_completed_store_tasks() == {}  # popped once

    tid = adapter.submit_lookup_and_lock_task([k(1)])
    assert t.wait_fd(adapter.get_lookup_and_lock_event_fd(), 10)
    assert not t.fd_ready(adapter.get_load_event_fd())
    assert adapter.query_lookup_and_lock_result(tid) == [True]
    assert adapter.query_lookup_and_lock_result(tid) is None  # one-shot

    buf = bytearray(CHUNK)
    tid = adapter.submit_load_task([k(1)], [buf])
    assert t.wait_fd(adapter.get_load_event_fd(), 10)
    assert adapter.query_load_result(tid) == [True]
    assert adapter.query_load_result(tid) is None
    assert buf == chunk(1)


def test_lock_refcount_protects_from_delete(adapter: ObjectStoreL2Adapter) -> None:
    t.store(adapter, [k(1), k(2)], [chunk(1), chunk(2)])
    assert t.lookup(adapter, [k(1)]) == [True]
    assert t.lookup(adapter, [k(1)]) == [True]  # two locks on k(1)
    assert adapter.delete([k(1), k(2)]) == [False, True]
    adapter.submit_unlock([k(1)])
    assert adapter.delete([k(1)]) == [False]  # one lock left
    adapter.submit_unlock([k(1)])
    adapter.submit_unlock([k(1)])  # extra unlock is harmless
    assert adapter.delete([k(1)]) == [True]
    assert adapter.get_usage().bytes_used == 0
    assert t.lookup(adapter, [k(1), k(2)]) == [False, False]
    assert not adapter.store.exists(key_to_name(k(1)))


def test_close_completes_later_submits_as_failed(store) -> None:
    a = ObjectStoreL2Adapter(store, owns_store=False)
    t.store(a, [k(1)], [chunk(1)])
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()]
    a.close()
    a.close()  # idempotent
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by close()
    sid = a.submit_store_task([k(2)], [chunk(2)])
    res = a.pop_completed_store_tasks()[sid]
    assert not res.success and res.landed == (False,)
    lid = a.submit_lookup_and_lock_task([k(1)])
    assert a.query_lookup_and_lock_result(lid) == [False]
    did = a.submit_load_task([k(1)], [bytearray(CHUNK)])
    assert a.query_load_result(did) == [False]
    assert a.delete([k(1)]) == [False]
    assert a.report_status()["is_healthy"] is False
    assert not store.exists(key_to_name(k(2)))


def test_unfull_chunks_refused_and_load_size_mismatch_is_a_miss(adapter: ObjectStoreL2Adapter) -> None:
    res = t.store(adapter, [k(1), k(2)], [chunk(1), chunk(2, CHUNK // 2)])
    assert not res.success and res.landed == (True, False) and res.bytes_stored == CHUNK
    assert adapter.get_usage().bytes_used == CHUNK
    assert not adapter.store.exists(key_to_name(k(2)))
    # an object of the wrong size written behind the adapter's back: lookup and load miss
    adapter.store.put(key_to_name(k(3)), chunk(3, CHUNK + 8))
    assert t.lookup(adapter, [k(3)]) == [False]
    buf = bytearray(b"\x07" * CHUNK)
    assert t.load(adapter, [k(3)], [buf]) == [False]
    assert buf == bytearray(b"\x07" * CHUNK)  # untouched, never overflowed
    assert adapter.report_status()["size_mismatches"] == 1


def test_restore_is_not_double_counted_and_salts_are_separate(adapter: ObjectStoreL2Adapter) -> None:
    t.store(adapter, [k(1), k(2, "alice")], [chunk(1), chunk(2)])
    t.store(adapter, [k(1), k(2, "alice")], [chunk(1), chunk(2)])
    t.store(adapter, [k(1)], [chunk(1)])
    u = adapter.get_usage()
    assert u.bytes_used == 2 * CHUNK
    assert dict(u.bytes_by_cache_salt) == {"": CHUNK, "alice": CHUNK}
    assert u.capacity_bytes == 0 and u.usage_fraction == -1.0
    # same hash, other salt: a different object
    assert t.lookup(adapter, [k(2), k(2, "alice"), k(2, "bob")]) == [False, True, False]


def test_key_written_by_another_writer_is_found(store) -> None:
    a = ObjectStoreL2Adapter(store, owns_store=False, metadata_cache_ttl_secs=0)
    b = ObjectStoreL2Adapter(store, owns_store=False, metadata_cache_ttl_secs=0)
    try:
        assert t.lookup(a, [k(5)]) == [False]
        t.store(b, [k(5)], [chunk(5)])
        assert t.lookup(a, [k(5)]) == [True]
        assert a.get_usage().bytes_used == CHUNK  # found by head, now counted
        # b deletes it; a's load misses and a forgets it
        a.submit_unlock([k(5)])
        assert b.delete([k(5)]) == [True]
        assert t.load(a, [k(5)], [bytearray(CHUNK)]) == [False]
        assert a.get_usage().bytes_used == 0
    finally:
        a.close()
        b.close()


def test_list_keys_paginates_by_model(adapter: ObjectStoreL2Adapter) -> None:
    keys = [k(i) for i in range(7)] + [k(i, model="other") for i in range(3)]
    t.store(adapter, keys, [chunk(i) for i in range(10)])
    seen = []
    cursor = None
    pages = 0
    while True:
        page = adapter.list_keys("org/model-a", page_size=3, cursor=cursor)
        pages += 1
        seen += [key for key, size in page.entries if size == CHUNK]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert pages == 3 and sorted(seen, key=str) == sorted(keys[:7], key=str)
    assert len(adapter.list_keys(page_size=100).entries) == 10
    with pytest.raises(ValueError, match="page_size"):
        adapter.list_keys(page_size=0)


def test_usage_rebuilt_after_restart(tmp_path) -> None:
    a = ObjectStoreL2Adapter(FileStore(tmp_path / "kv"))
    t.store(a, [k(i) for i in range(5)], [chunk(i) for i in range(5)])
    t.store(a, [k(9, "t1")], [chunk(9)])
    before = a.get_usage()
    a.close()
    (tmp_path / "kv" / "not-a-key.txt").write_bytes(b"x")  # a foreign object is not counted
    b = ObjectStoreL2Adapter(FileStore(tmp_path / "kv"))
    try:
        assert b.wait_until_rebuilt(10)
        after = b.get_usage()
        assert after.complete
        assert after.bytes_used == before.bytes_used == 6 * CHUNK
        assert dict(after.bytes_by_cache_salt) == dict(before.bytes_by_cache_salt)
        assert t.lookup(b, [k(3), k(9, "t1")]) == [True, True]
        assert b.report_status()["foreign_objects"] == 1
    finally:
        b.close()


def test_lookup_with_layout_size_counts_other_sizes_as_misses(store) -> None:
    a = ObjectStoreL2Adapter(store, owns_store=False)
    try:
        t.store(a, [k(1), k(2)], [chunk(1, 100), chunk(2, 100)])
        a.submit_lookup_and_lock_task([k(1)], 200)  # layout says a full chunk is 200 bytes
        assert t.lookup(a, [k(1)]) == [False]
        res = t.store(a, [k(3)], [chunk(3, 200)])
        assert res.success and t.lookup(a, [k(3)]) == [True]
    finally:
        a.close()


def test_eviction_config_rejects_ratio_above_watermark() -> None:
    with pytest.raises(ValueError, match="eviction_ratio"):
        EvictionConfig(eviction_policy="LRU", trigger_watermark=0.5, eviction_ratio=0.6)


def test_mixed_sizes_are_found_again_after_a_restart(tmp_path) -> None:
    a = ObjectStoreL2Adapter(FileStore(tmp_path / "kv"))
    t.store(a, [k(1), k(2)], [chunk(1), chunk(2, CHUNK // 4)])
    a.close()
    b = ObjectStoreL2Adapter(FileStore(tmp_path / "kv"))
    try:
        assert b.wait_until_rebuilt(10)
        assert t.lookup(b, [k(1), k(2)]) == [True, True]
        bufs = [bytearray(CHUNK), bytearray(CHUNK // 4)]
        assert t.load(b, [k(1), k(2)], bufs) == [True, True]
        assert bytes(bufs[1]) == chunk(2, CHUNK // 4)
    finally:
        b.close()


def test_a_stored_key_is_named_once_for_its_lookups_and_loads(
    adapter: ObjectStoreL2Adapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding a key's names is the costliest part of a lookup answered from the index (bench_l2
    lookups fell 3x when stores stopped filling the name cache): a key stored here is not named again."""
    named: list[ObjectKey] = []
    real = adapter.naming.read_names
    monkeypatch.setattr(adapter.naming, "read_names", lambda key: named.append(key) or real(key))
    keys = [k(i) for i in range(4)]
    assert t.store(adapter, keys, [chunk(i) for i in range(4)]).success
    assert named == keys
    assert t.lookup(adapter, keys) == [True] * 4
    assert t.load(adapter, keys, [bytearray(CHUNK) for _ in keys]) == [True] * 4
    assert named == keys


class _HeldListing(FileStore):
    """A directory whose listing (the adapter's startup rebuild) waits until ``release`` is set."""

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[Any]:
        assert self.release.wait(30)
        yield from super().list(prefix, page_size=page_size)


def test_the_start_listing_does_not_bring_back_a_chunk_a_load_refused_and_kept(tmp_path) -> None:
    """A load that refuses an intact chunk (here another key's bytes under this name) keeps it in
    the store and forgets it; the index rebuilt from the store's listing, ending after that load,
    must not add the chunk back (lookups would answer hits this reader cannot load)."""
    k, other = ObjectKey("org/llama", 0, b"\x02" * 16), ObjectKey("org/llama", 0, b"\x03" * 16)
    store = _HeldListing(tmp_path)
    with ObjectStoreL2Adapter(store, owns_store=False) as a:
        assert t.store(a, [k, other], [b"\x02" * 4096, b"\x03" * 4096]).success
        name = key_to_name(k)
        raw = FileStore(tmp_path)
        raw.put(name, raw.get(key_to_name(other)) or b"")  # intact, but not this name's
        assert t.load(a, [k], [bytearray(4096)]) == [False]  # refused, kept: the listing still runs
        assert raw.exists(name)
        store.release.set()
        assert a.wait_until_rebuilt(30)
        st = a._state
        assert name not in st.index
        assert t.lookup(a, [k]) == [False]
