"""The seeds' full-chunk rules, timeouts, the pipelined get, and the hybrid's promotion."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend, layout_identity
from kvbucket.chunks import ChunkSizeError, KVLayout
from kvbucket.errors import TransientStoreError
from kvbucket.keys import key_to_name
from kvbucket.stores.base import Buffer, ItemResult
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key

LAYOUT = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)
FULL = LAYOUT.full_chunk_bytes


class CountingStore(MemoryStore):
    """A MemoryStore that counts calls and can be made slow (a stand-in for a far server)."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.calls: dict[str, int] = {"put": 0, "get": 0, "head": 0, "delete": 0}
        self.delay = 0.0
        self.release = threading.Event()
        self.release.set()
        self.inflight = 0
        self.max_inflight = 0
        self._count_lock = threading.Lock()

    def _slow(self, verb: str) -> None:
        with self._count_lock:
            self.calls[verb] += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay:
                time.sleep(self.delay)
            self.release.wait(10)
        finally:
            with self._count_lock:
                self.inflight -= 1

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        self._slow("put")
        return super().put_many(items)

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        self._slow("get")
        return super().get_many(names, out)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._slow("head")
        return super().head_many(names)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._slow("delete")
        return super().delete_many(names)


# ---- full-chunk rules ---------------------------------------------------------------------------


def test_partial_chunk_refused_with_sizes_in_the_message() -> None:
    with RemoteBackend(MemoryStore(), LAYOUT) as b:
        with pytest.raises(ChunkSizeError) as e:
            b.put(key(1), b"x" * (FULL - 1))
        msg = str(e.value)
        assert f"{FULL - 1} bytes" in msg and f"full chunk is {FULL} bytes" in msg
        assert "save_unfull_chunk" in msg
        assert b.list() == [] and not b.contains(key(1))


def test_batched_put_counts_only_what_landed_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with RemoteBackend(MemoryStore(), LAYOUT) as b, caplog.at_level(logging.WARNING):
        items = [(key(1), chunk_bytes(LAYOUT, 1)), (key(2), b"short"), (key(3), chunk_bytes(LAYOUT, 3))]
        assert b.batched_put(items) == 2
        assert any(key(2).to_string() in r.message and "full chunk" in r.message for r in caplog.records)
        results = b.batched_put_results(items)
        assert results[0] is None and isinstance(results[1], ChunkSizeError) and results[2] is None
        assert sorted(b.list()) == sorted([key(1).to_string(), key(3).to_string()])


def test_wrong_sized_stored_object_is_a_miss_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    store.put(key_to_name(key(7)), b"z" * (FULL + 8))  # written by something else
    sealed = seal_store(store, tier="remote", identity=layout_identity(LAYOUT))  # as RemoteBackend writes
    sealed.put(key_to_name(key(8)), chunk_bytes(LAYOUT, 8))
    with RemoteBackend(store, LAYOUT, owns_store=False) as b, caplog.at_level(logging.WARNING):
        assert b.get(key(7)) is None
        assert b.batched_get([key(7), key(8)])[0] is None
        assert as_bytes(b.batched_get([key(7), key(8)])[1]) == chunk_bytes(LAYOUT, 8)
        assert not b.contains(key(7))
        assert b.list() == [key(8).to_string()]
        name = key_to_name(key(7))
        refusals = [r for r in caplog.records if "refused" in r.message and name in r.message]
        assert len(refusals) == 1


def test_save_unfull_chunk_true_keeps_partial_chunks() -> None:
    with RemoteBackend(MemoryStore(), LAYOUT, save_unfull_chunk=True) as b:
        b.put(key(1), b"partial")
        assert as_bytes(b.get(key(1))) == b"partial"
        assert b.contains(key(1))


def test_list_skips_foreign_objects_and_other_prefixes(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("README", b"not a chunk")
    store.put("other/" + key_to_name(key(2)), chunk_bytes(LAYOUT, 2))
    with RemoteBackend(store, LAYOUT, prefix="mine") as b:
        b.put(key(1), chunk_bytes(LAYOUT, 1))
        assert b.list() == [key(1).to_string()]
        assert store.exists("mine/" + key_to_name(key(1)))


# ---- existence cache ------------------------------------------------------------------------------


def test_contains_uses_a_cache_invalidated_by_put_and_remove() -> None:
    store = CountingStore()
    with RemoteBackend(store, LAYOUT, owns_store=False) as b:
        b.put(key(1), chunk_bytes(LAYOUT, 1))
        heads = store.calls["head"]
        assert b.contains(key(1)) and b.contains(key(1))
        assert store.calls["head"] == heads  # answered from the size cache the put filled
        assert b.remove(key(1))
        assert not b.contains(key(1))
        assert store.calls["head"] > heads  # the removal invalidated it


# ---- timeouts ----------------------------------------------------------------------------------------


def test_blocking_timeout_is_a_clear_error_and_nothing_is_counted() -> None:
    store = CountingStore()
    store.release.clear()  # every call hangs until released
    b = RemoteBackend(store, LAYOUT, blocking_timeout_secs=0.2, owns_store=False)
    try:
        with pytest.raises(TransientStoreError, match=r"did not finish within blocking_timeout_secs=0.2s"):
            b.put(key(1), chunk_bytes(LAYOUT, 1))
        assert b.batched_put([(key(2), chunk_bytes(LAYOUT, 2))]) == 0
        # Reads and lookups are misses at the timeout (the engine recomputes), counted.
        assert b.get(key(1)) is None and b.read_failures == 1
        assert b.contains(key(1)) is False and b.lookup_failures == 1
    finally:
        store.release.set()
        b.close()


# ---- pipelined get ------------------------------------------------------------------------------------


def test_pipelined_get_keeps_input_order_with_misses_and_bad_objects() -> None:
    store = CountingStore()
    store.delay = 0.002
    with PipelinedRemoteBackend(store, LAYOUT, pipeline_batch=3, max_inflight=2, owns_store=False) as b:
        items = [(key(i), chunk_bytes(LAYOUT, i)) for i in range(20)]
        assert b.batched_put(items) == 20
        store.put(key_to_name(key(5)), b"bad size")
        asked: list[Any] = [key(i) for i in reversed(range(25))]
        got = b.batched_get(asked)
        for k, g in zip(asked, got, strict=True):
            i = next(j for j in range(25) if key(j) == k)
            if i >= 20 or i == 5:
                assert g is None
            else:
                assert as_bytes(g) == chunk_bytes(LAYOUT, i)
        # 25 keys in sub-batches of 3, one store call each, plus one whole read of the bad object
        # (the sealing layer reads a wrong-sized object once to log why it is refused)
        assert store.calls["get"] == 10


def test_pipelined_get_overlaps_network_calls() -> None:
    store = CountingStore()
    with PipelinedRemoteBackend(store, LAYOUT, pipeline_batch=1, max_inflight=4, io_threads=4,
                                owns_store=False) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(8)])
        store.delay = 0.05
        store.max_inflight = 0
        got = b.batched_get([key(i) for i in range(8)])
    assert all(g is not None for g in got)
    # several fetches were in flight at once, and never more than the bounded window allows
    assert 2 <= store.max_inflight <= 4


# ---- hybrid ----------------------------------------------------------------------------------------------


def test_hybrid_promotes_lower_tier_hits(tmp_path: Path) -> None:
    remote_store = MemoryStore()
    remote = RemoteBackend(remote_store, LAYOUT, owns_store=False)
    remote.put(key(1), chunk_bytes(LAYOUT, 1))  # written by another machine, only remote has it
    cpu = LocalCPUBackend(10 * FULL)
    disk = LocalDiskBackend(tmp_path / "disk", 10 * FULL)
    with HybridBackend([cpu, disk, remote]) as h:
        assert not cpu.contains(key(1)) and not disk.contains(key(1))
        assert as_bytes(h.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert h.hits == [0, 0, 1]
        assert as_bytes(cpu.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert as_bytes(disk.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert as_bytes(h.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert h.hits == [1, 0, 1]
        assert h.get(key(2)) is None and h.misses == 1


def test_hybrid_get_into_promotes_from_the_callers_buffer(tmp_path: Path) -> None:
    remote = RemoteBackend(MemoryStore(), LAYOUT)
    remote.put(key(1), chunk_bytes(LAYOUT, 1))
    cpu = LocalCPUBackend(10 * FULL)
    with HybridBackend([cpu, remote]) as h:
        buf = bytearray(FULL)
        assert h.get_into(key(1), buf) and bytes(buf) == chunk_bytes(LAYOUT, 1)
        buf[:] = b"\x00" * FULL  # the caller reuses its buffer: the promoted copy is unaffected
        assert as_bytes(cpu.get(key(1))) == chunk_bytes(LAYOUT, 1)
        assert h.hits == [0, 1]


def test_hybrid_contains_asks_fast_tiers_first() -> None:
    store = CountingStore()
    cpu = LocalCPUBackend(10 * FULL)
    with HybridBackend([cpu, RemoteBackend(store, LAYOUT, exists_cache_ttl_secs=0)]) as h:
        h.put(key(1), chunk_bytes(LAYOUT, 1))
        heads = store.calls["head"]
        assert h.contains(key(1))
        assert store.calls["head"] == heads
        assert not h.contains(key(2))
        assert store.calls["head"] == heads + 1


def test_hybrid_write_through_reports_the_tier_that_failed() -> None:
    cpu = LocalCPUBackend(10 * FULL)
    remote = RemoteBackend(MemoryStore(), LAYOUT)
    with HybridBackend([cpu, remote]) as h:
        assert h.batched_put([(key(1), chunk_bytes(LAYOUT, 1)), (key(2), b"partial")]) == 1
        (err,) = h.batched_put_results([(key(3), b"partial")])
        assert err is not None and "1 of 2 tiers refused it" in str(err) and "RemoteBackend" in str(err)
        assert remote.contains(key(1)) and not remote.contains(key(2))


def test_hybrid_batched_get_goes_down_only_for_misses() -> None:
    store = CountingStore()
    cpu = LocalCPUBackend(10 * FULL)
    with HybridBackend([cpu, RemoteBackend(store, LAYOUT)]) as h:
        h.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(4)])
        gets = store.calls["get"]
        assert all(g is not None for g in h.batched_get([key(i) for i in range(4)]))
        assert store.calls["get"] == gets
        cpu.remove(key(2))
        got = h.batched_get([key(i) for i in range(4)])
        assert store.calls["get"] == gets + 1
        assert [as_bytes(g) for g in got] == [chunk_bytes(LAYOUT, i) for i in range(4)]


class ReadThenWaitStore(MemoryStore):
    """get_many reads the objects, then waits: a slow response carrying an old version."""

    def __init__(self) -> None:
        super().__init__("slow-reads")
        self.read_done = threading.Event()
        self.release = threading.Event()
        self.hold = False

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        results = super().get_many(names, out)
        if self.hold:
            self.read_done.set()
            self.release.wait(10)
        return results


@pytest.mark.parametrize("blocking", [True, False])
def test_promotion_never_overwrites_a_newer_put(blocking: bool) -> None:
    store = ReadThenWaitStore()
    cpu = LocalCPUBackend(10 * FULL)
    remote = RemoteBackend(store, LAYOUT)
    remote.put(key(1), chunk_bytes(LAYOUT, 1))  # v1, only in the remote tier
    with HybridBackend([cpu, remote]) as h:
        store.hold = True
        result: list[Any] = []
        reader = threading.Thread(target=lambda: result.append(h.get(key(1))))
        reader.start()
        assert store.read_done.wait(10)  # the reader holds v1 and has not promoted it yet
        store.hold = False
        h.put(key(1), chunk_bytes(LAYOUT, 2), blocking=blocking)  # v2 lands meanwhile
        store.release.set()
        reader.join()
        h.flush()
        assert as_bytes(result[0]) == chunk_bytes(LAYOUT, 1)  # the reader got what it read
        assert as_bytes(cpu.get(key(1))) == chunk_bytes(LAYOUT, 2)  # but memory keeps the newer v2
        assert as_bytes(h.get(key(1))) == chunk_bytes(LAYOUT, 2)
        assert h.promotions_skipped == 1
