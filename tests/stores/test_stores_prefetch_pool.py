"""PrefetchStore's free pool: a buffer a load copied out of is reused by the next read-ahead (no
fresh buffer, no first-touch page faults per batch), held + pooled bytes never pass the bound,
the pool is freed when no read-ahead comes, and a buffer is recycled only when its read
succeeded and the load copied out of it. Counts, never times."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvbucket.stores.base import Buffer, ItemResult, Scatter
from kvbucket.stores.guard.read_ahead import PARALLEL_COPY_BYTES, PrefetchStore
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.fleet_node import until

SIZE = 64 * 1024


class WatchedStore(CountingStore):
    """Counts calls and records the largest held + pooled bytes seen while a read runs."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.watch: PrefetchStore | None = None
        self.peak = 0

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        if self.watch is not None:
            self.peak = max(self.peak, self.watch.held_bytes + self.watch.pooled_bytes)
        return super().get_many(names, out)


def filled(n: int, size: int = SIZE, prefix: str = "k") -> tuple[WatchedStore, list[str], list[bytes]]:
    raw = WatchedStore()
    names = [f"{prefix}{i}" for i in range(n)]
    data = [os.urandom(size) for _ in names]
    assert all(r.ok for r in raw.put_many(list(zip(names, data, strict=True))))
    raw.reset()
    return raw, names, data


def load(pf: PrefetchStore, names: list[str], size: int = SIZE) -> list[bytes]:
    bufs = [np.zeros(size, np.uint8) for _ in names]
    res = pf.get_many(names, bufs)
    assert all(r.found for r in res)
    return [b.tobytes() for b in bufs]


def test_a_load_recycles_the_read_ahead_buffers() -> None:
    raw, names, data = filled(6)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 10.0), label="pool")
    try:
        for _ in range(3):
            assert pf.prefetch(names, [SIZE] * 6) == 6 * SIZE
            assert pf.settle()
            raw.reset()
            assert load(pf, names) == data
            assert raw.total_calls == 0  # served from the read-ahead
            assert pf.held_bytes == 0 and pf.pooled_bytes == 6 * SIZE
        assert pf.allocated == 6 and pf.reused == 12  # one buffer per entry, then the same ones
    finally:
        pf.close()
    assert pf.pooled_bytes == 0  # closed: the pool is freed


def test_held_and_pooled_bytes_never_pass_the_bound() -> None:
    raw, names, data = filled(4)
    big_raw_names = [f"b{i}" for i in range(2)]
    big = [os.urandom(2 * SIZE) for _ in big_raw_names]
    raw.put_many(list(zip(big_raw_names, big, strict=True)))
    bound = 4 * SIZE
    pf = PrefetchStore(raw, ReadAheadSettings(True, bound, 10.0), label="pool")
    raw.watch = pf
    try:
        pf.prefetch(names, [SIZE] * 4)
        assert pf.settle()
        assert load(pf, names) == data
        assert pf.pooled_bytes == bound  # four free buffers of SIZE fill the bound
        # Another size needs room: pooled buffers are freed first, the bound holds.
        assert pf.prefetch(big_raw_names, [2 * SIZE] * 2) == 4 * SIZE
        assert pf.held_bytes + pf.pooled_bytes <= bound
        assert pf.pooled_bytes == 0 and pf.allocated == 6 and pf.reused == 0
        assert pf.settle()
        assert load(pf, big_raw_names, 2 * SIZE) == big
        assert pf.pooled_bytes == bound
        # The old size again: one 2*SIZE buffer is freed per two SIZE ones needed.
        pf.prefetch(names[:2], [SIZE] * 2)
        assert pf.held_bytes + pf.pooled_bytes <= bound
        assert pf.settle()
        raw.reset()
        assert load(pf, names[:2]) == data[:2]
        assert raw.total_calls == 0
        assert raw.peak <= bound
    finally:
        pf.close()


def test_the_pool_is_freed_when_no_read_ahead_comes() -> None:
    raw, names, data = filled(3)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 0.1), label="pool")
    try:
        pf.prefetch(names, [SIZE] * 3)
        assert pf.settle()
        assert load(pf, names) == data
        assert pf.pooled_bytes == 3 * SIZE
        assert until(lambda: pf.pooled_bytes == 0, 5)  # the sweeper frees it, no call needed
        pf.prefetch(names, [SIZE] * 3)
        assert pf.settle()
        assert load(pf, names) == data
        assert pf.allocated == 6 and pf.reused == 0
    finally:
        pf.close()


def test_only_buffers_a_load_copied_out_of_are_recycled() -> None:
    raw, names, data = filled(2)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 10.0), label="pool")
    try:
        # A load with no buffers keeps the read-ahead's own arrays: they never go back to the pool.
        pf.prefetch(names, [SIZE] * 2)
        assert pf.settle()
        got = pf.get_many(names)
        assert [bytes(memoryview(r.data)) for r in got] == data  # type: ignore[arg-type]
        assert pf.pooled_bytes == 0
        # A read that found nothing is not recycled either (a failed read may still be written to).
        assert pf.prefetch(["absent"], [SIZE]) == SIZE
        assert pf.settle()
        assert pf.held_bytes == 0 and pf.pooled_bytes == 0
        # A buffer of the wrong size gets its error and the entry is still released.
        pf.prefetch(names[:1], [SIZE])
        assert pf.settle()
        res = pf.get_many(names[:1], [np.zeros(SIZE - 1, np.uint8)])
        assert res[0].error is not None
        assert pf.held_bytes == 0
    finally:
        pf.close()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_large_loads_copy_on_two_threads_byte_for_byte(n: int) -> None:
    size = PARALLEL_COPY_BYTES // 2 + 4096  # two or more entries pass the parallel threshold
    raw, names, data = filled(n, size)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 16 * size, 10.0), label="pool")
    try:
        for _ in range(2):
            pf.prefetch(names, [size] * n)
            assert pf.settle()
            raw.reset()
            assert load(pf, names, size) == data
            assert raw.total_calls == 0
        # Scatter destinations (a sealed header + payload) take the same path.
        pf.prefetch(names, [size] * n)
        assert pf.settle()
        heads = [np.zeros(16, np.uint8) for _ in names]
        tails = [np.zeros(size - 16, np.uint8) for _ in names]
        res = pf.get_many(names, [Scatter(h, t) for h, t in zip(heads, tails, strict=True)])
        assert all(r.found for r in res)
        assert [h.tobytes() + t.tobytes() for h, t in zip(heads, tails, strict=True)] == data
        assert pf.allocated == n and pf.reused == 2 * n
    finally:
        pf.close()


def test_a_busy_copy_helper_never_holds_a_load_or_skips_a_copy() -> None:
    size = PARALLEL_COPY_BYTES // 2 + 4096
    raw, names, data = filled(4, size)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 16 * size, 10.0), label="pool")
    release = threading.Event()
    try:
        blocker = pf._copier.submit(release.wait, 30)  # the helper is busy with another load
        pf.prefetch(names, [size] * 4)
        assert pf.settle()
        got: list[list[bytes]] = []
        t = threading.Thread(target=lambda: got.append(load(pf, names, size)))
        t.start()
        t.join(20)
        assert not t.is_alive() and not blocker.done()  # served without the helper
        assert got == [data]  # its half was copied by the loading thread
        assert pf.held_bytes == 0 and pf.pooled_bytes == 4 * size
    finally:
        release.set()
        pf.close()


def test_the_gauges_show_held_and_pooled_bytes() -> None:
    """``kvbucket_read_ahead_held_bytes`` and ``..._pooled_bytes`` follow the buffer: an operator
    sees the memory the read-ahead really holds (their sum), pooled buffers included."""
    from prometheus_client import REGISTRY

    def gauges() -> tuple[float | None, float | None]:
        return tuple(REGISTRY.get_sample_value(f"kvbucket_read_ahead_{what}_bytes", {"store": "gauges"})
                     for what in ("held", "pooled"))  # type: ignore[return-value]

    raw, names, data = filled(3)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 0.2), label="gauges")
    try:
        assert pf.prefetch(names, [SIZE] * 3) == 3 * SIZE
        assert gauges() == (3 * SIZE, 0)
        assert pf.settle()
        assert load(pf, names) == data
        assert gauges() == (0, 3 * SIZE)  # copied out: the buffers wait in the pool
        assert pf.prefetch(names[:1], [SIZE]) == SIZE
        assert gauges() == (SIZE, 2 * SIZE)  # one taken from the pool
        assert until(lambda: gauges() == (0, 0), 5)  # expired, then the pool freed by the sweeper
    finally:
        pf.close()
    assert gauges() == (0, 0)


def test_the_gauges_add_up_over_stores_of_one_label() -> None:
    """Issue 29 item 10: each store set the label's gauge to its own bytes, so two stores of one
    label (two tiers, two adapters) showed whichever moved last."""
    from prometheus_client import REGISTRY

    def gauges() -> tuple[float | None, float | None]:
        return tuple(REGISTRY.get_sample_value(f"kvbucket_read_ahead_{what}_bytes", {"store": "shared"})
                     for what in ("held", "pooled"))  # type: ignore[return-value]

    (raw_a, names_a, data_a), (raw_b, names_b, _) = filled(3, prefix="a"), filled(2, prefix="b")
    a = PrefetchStore(raw_a, ReadAheadSettings(True, 64 * SIZE, 60.0), label="shared")
    b = PrefetchStore(raw_b, ReadAheadSettings(True, 64 * SIZE, 60.0), label="shared")
    try:
        assert a.prefetch(names_a, [SIZE] * 3) == 3 * SIZE
        assert b.prefetch(names_b, [SIZE] * 2) == 2 * SIZE
        assert gauges() == (5 * SIZE, 0)
        assert a.settle() and load(a, names_a) == data_a
        assert gauges() == (2 * SIZE, 3 * SIZE)  # a's buffers pooled, b's still held
        b.stop()
        assert gauges() == (0, 3 * SIZE)
    finally:
        a.close()
        b.close()
    assert gauges() == (0, 0)


def test_drop_unused_frees_only_what_no_load_took() -> None:
    """``drop_unused``: the names whose read-ahead no load took, forgotten (counted wasted once
    landed); taken ones and names never read ahead are left alone."""
    raw, names, data = filled(4)
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 60.0), label="drop")
    try:
        pf.prefetch(names, [SIZE] * 4)
        assert pf.settle()
        assert load(pf, names[:2]) == data[:2]
        assert sorted(pf.drop_unused([*names, "never"])) == names[2:]
        assert pf.held_bytes == 0 and pf.drop_unused(names) == []
        raw.reset()
        assert load(pf, names[2:]) == data[2:]
        assert raw.total_calls == 1  # dropped: the load asked the store
    finally:
        pf.close()
