"""``BackendTests``: the conformance suite every :class:`~kvbucket.backends.base.StorageBackend` passes.

Same pattern as :mod:`kvbucket.testing.store_tests`: subclass it, provide a ``backend`` fixture
that yields a fresh, empty backend for the class's ``layout``, declare capabilities, and pytest
collects every test below against your backend::

    import pytest
    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.testing.backend_tests import BackendTests

    class TestMyRemote(BackendTests):
        refuses_unfull_chunks = True

        @pytest.fixture
        def backend(self, my_store):
            with RemoteBackend(my_store, self.layout) as b:
                yield b

Capabilities (class attributes; a missing one is a *reported* skip, never a silent pass):

- ``layout``: the :class:`KVLayout` the backend is built for (small by default: 4 KiB chunks).
- ``refuses_unfull_chunks``: a chunk that is not ``layout.full_chunk_bytes`` is refused on put
  (remote tiers with ``save_unfull_chunk=False``, and stacks that contain one).
- ``bounded``: the backend is a byte-bounded LRU tier; implement :meth:`make_bounded` to build
  one holding ``capacity_bytes``.
- ``supports_reopen``: a backend built again on the same location sees acknowledged chunks;
  implement :meth:`reopen`.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbucket.backends.base import BackendClosedError, StorageBackend
from kvbucket.chunks import KVLayout, as_view
from kvbucket.keys import CacheEngineKey

MODEL = "meta-llama/Llama-3.1-8B"


def chunk_bytes(layout: KVLayout, seed: int, size: int | None = None) -> bytes:
    """Deterministic bytes that differ at every offset (catches shifted or mixed-up chunks)."""
    n = layout.full_chunk_bytes if size is None else size
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def key(i: int, model: str = MODEL) -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, (i * 0x9E3779B97F4A7C15) % (1 << 63) - (1 << 62), "bfloat16")


def as_bytes(chunk: Any) -> bytes:
    return as_view(chunk).tobytes()


class BackendTests:
    layout: ClassVar[KVLayout] = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, dtype="bfloat16",
                                          chunk_tokens=16)
    refuses_unfull_chunks: ClassVar[bool] = False
    bounded: ClassVar[bool] = False
    supports_reopen: ClassVar[bool] = False

    # ---- hooks -------------------------------------------------------------------------------
    def make_bounded(self, capacity_bytes: int, request: pytest.FixtureRequest) -> StorageBackend:
        raise NotImplementedError("set bounded = True and implement make_bounded")

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        raise NotImplementedError("set supports_reopen = True and implement reopen")

    @pytest.fixture
    def backend(self) -> StorageBackend:
        raise NotImplementedError("provide a `backend` fixture yielding a fresh, empty backend")

    # ---- round trips ---------------------------------------------------------------------------
    def test_put_get_round_trip(self, backend: StorageBackend) -> None:
        data = chunk_bytes(self.layout, 1)
        backend.put(key(1), data)
        got = backend.get(key(1))
        assert got is not None
        assert as_bytes(got) == data

    def test_get_missing_is_none(self, backend: StorageBackend) -> None:
        assert backend.get(key(404)) is None
        assert not backend.contains(key(404))

    def test_contains_after_put(self, backend: StorageBackend) -> None:
        backend.put(key(2), chunk_bytes(self.layout, 2))
        assert backend.contains(key(2))
        assert not backend.contains(key(3))

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy_uint8", "numpy_float16"])
    def test_accepts_bytes_like_chunks(self, backend: StorageBackend, kind: str) -> None:
        data = chunk_bytes(self.layout, 5)
        chunk: Any = {
            "bytes": lambda: data,
            "bytearray": lambda: bytearray(data),
            "memoryview": lambda: memoryview(data),
            "numpy_uint8": lambda: np.frombuffer(data, dtype=np.uint8).copy(),
            "numpy_float16": lambda: np.frombuffer(data, dtype=np.float16).reshape(self.layout.shape).copy(),
        }[kind]()
        backend.put(key(5), chunk)
        assert as_bytes(backend.get(key(5))) == data

    def test_accepts_torch_bfloat16_tensor(self, backend: StorageBackend) -> None:
        torch = pytest.importorskip("torch")
        t = torch.randn(self.layout.shape, dtype=torch.float32).to(torch.bfloat16)
        expected = t.view(torch.uint8).numpy().tobytes()
        assert len(expected) == self.layout.full_chunk_bytes
        backend.put(key(6), t)
        assert as_bytes(backend.get(key(6))) == expected

    def test_returned_chunk_is_read_only(self, backend: StorageBackend) -> None:
        backend.put(key(7), chunk_bytes(self.layout, 7))
        view = memoryview(backend.get(key(7)))
        assert view.readonly

    def test_caller_may_reuse_buffer_after_blocking_put(self, backend: StorageBackend) -> None:
        data = chunk_bytes(self.layout, 8)
        buf = bytearray(data)
        backend.put(key(8), buf)
        buf[:] = b"\x00" * len(buf)
        assert as_bytes(backend.get(key(8))) == data

    def test_overwrite(self, backend: StorageBackend) -> None:
        backend.put(key(9), chunk_bytes(self.layout, 90))
        backend.put(key(9), chunk_bytes(self.layout, 91))
        assert as_bytes(backend.get(key(9))) == chunk_bytes(self.layout, 91)

    def test_remove(self, backend: StorageBackend) -> None:
        backend.put(key(10), chunk_bytes(self.layout, 10))
        assert backend.remove(key(10)) is True
        assert backend.get(key(10)) is None
        assert not backend.contains(key(10))
        assert backend.remove(key(10)) is False

    def test_key_object_and_string_are_the_same_key(self, backend: StorageBackend) -> None:
        backend.put(key(11), chunk_bytes(self.layout, 11))
        assert as_bytes(backend.get(key(11).to_string())) == chunk_bytes(self.layout, 11)
        assert backend.contains(key(11).to_string())

    def test_list_gives_key_strings(self, backend: StorageBackend) -> None:
        keys = [key(i) for i in range(20, 25)] + [
            CacheEngineKey("org/model.v2", 8, 3, -0x41257AF1DD85C366, "float16", {"lora": "a/b"}),
        ]
        for i, k in enumerate(keys):
            backend.put(k, chunk_bytes(self.layout, 20 + i))
        listed = backend.list()
        assert sorted(listed) == sorted(k.to_string() for k in keys)
        assert {CacheEngineKey.from_string(s) for s in listed} == set(keys)

    # ---- batches --------------------------------------------------------------------------------
    def test_batched_put_and_get_in_input_order(self, backend: StorageBackend) -> None:
        items = [(key(i), chunk_bytes(self.layout, i)) for i in range(30, 38)]
        assert backend.batched_put(items) == len(items)
        asked = [key(99_001), *[k for k, _ in items[::-1]], key(99_002)]
        got = backend.batched_get(asked)
        assert len(got) == len(asked)
        assert got[0] is None and got[-1] is None
        assert [as_bytes(g) for g in got[1:-1]] == [d for _, d in items[::-1]]

    def test_batched_put_results_are_per_item(self, backend: StorageBackend) -> None:
        items: list[tuple[Any, Any]] = [
            (key(40), chunk_bytes(self.layout, 40)),
            (key(41), 12345),  # not a chunk
            (key(42), chunk_bytes(self.layout, 42)),
        ]
        results = backend.batched_put_results(items)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], Exception)
        assert backend.batched_put([(key(43), object()), (key(44), chunk_bytes(self.layout, 44))]) == 1
        too_long = CacheEngineKey("m" * 2000, 1, 0, 1, "bfloat16")  # longer than any object name may be
        (err, ok) = backend.batched_put_results([(too_long, chunk_bytes(self.layout, 45)),
                                                 (key(45), chunk_bytes(self.layout, 45))])
        assert ok is None and as_bytes(backend.get(key(45))) == chunk_bytes(self.layout, 45)
        if err is None:  # memory tiers take any key; then it must also read back
            assert as_bytes(backend.get(too_long)) == chunk_bytes(self.layout, 45)
        assert as_bytes(backend.get(key(42))) == chunk_bytes(self.layout, 42)
        assert backend.get(key(41)) is None and backend.get(key(43)) is None

    def test_get_into_caller_buffers(self, backend: StorageBackend) -> None:
        items = [(key(i), chunk_bytes(self.layout, i)) for i in range(45, 48)]
        backend.batched_put(items)
        full = self.layout.full_chunk_bytes
        bufs: list[Any] = [bytearray(full), np.zeros(full, dtype=np.uint8), bytearray(full), bytearray(full)]
        asked = [items[2][0], items[0][0], key(99_003), items[1][0]]
        assert backend.batched_get_into(asked, bufs) == [True, True, False, True]
        assert bytes(bufs[0]) == items[2][1]
        assert bufs[1].tobytes() == items[0][1]
        assert bytes(bufs[2]) == b"\x00" * full  # a miss leaves the buffer untouched
        assert bytes(bufs[3]) == items[1][1]
        small = bytearray(full - 1)
        assert backend.get_into(items[0][0], small) is False  # wrong size: a miss, nothing written
        assert bytes(small) == b"\x00" * (full - 1)
        with pytest.raises(ValueError, match="got 1 keys but 2 buffers"):
            backend.batched_get_into([items[0][0]], [bytearray(full), bytearray(full)])

    # ---- non-blocking puts --------------------------------------------------------------------
    def test_non_blocking_puts_land(self, backend: StorageBackend) -> None:
        items = [(key(i), chunk_bytes(self.layout, i)) for i in range(50, 60)]
        for k, d in items:
            backend.put(k, d, blocking=False)
        assert as_bytes(backend.get(items[0][0])) == items[0][1]  # read your own writes
        backend.flush()
        assert [as_bytes(g) for g in backend.batched_get([k for k, _ in items])] == [d for _, d in items]

    def test_non_blocking_batched_put_counts_accepted(self, backend: StorageBackend) -> None:
        items = [(key(i), chunk_bytes(self.layout, i)) for i in range(60, 64)]
        assert backend.batched_put(items, blocking=False) == 4
        backend.flush()
        assert all(backend.contains(k) for k, _ in items)

    def test_remove_cancels_a_queued_put(self, backend: StorageBackend) -> None:
        for i in range(70, 78):
            backend.put(key(i), chunk_bytes(self.layout, i), blocking=False)
        backend.remove(key(77))
        backend.flush()
        assert backend.get(key(77)) is None
        assert as_bytes(backend.get(key(76))) == chunk_bytes(self.layout, 76)

    def test_close_is_idempotent_and_refuses_later_puts(self, backend: StorageBackend) -> None:
        backend.put(key(80), chunk_bytes(self.layout, 80))
        backend.close()
        backend.close()
        with pytest.raises(BackendClosedError, match="is closed"):
            backend.put(key(81), chunk_bytes(self.layout, 81))
        with pytest.raises(BackendClosedError):
            backend.batched_put([(key(82), chunk_bytes(self.layout, 82))])

    # ---- the full-chunk rule -------------------------------------------------------------------
    def test_unfull_chunk_refused(self, backend: StorageBackend) -> None:
        if not self.refuses_unfull_chunks:
            pytest.skip("this backend keeps partial chunks (refuses_unfull_chunks = False)")
        full = self.layout.full_chunk_bytes
        with pytest.raises(Exception, match=rf"full chunk is {full} bytes"):
            backend.put(key(90), chunk_bytes(self.layout, 90, full - 2))
        n = backend.batched_put([(key(91), chunk_bytes(self.layout, 91, full + 2)),
                                 (key(92), chunk_bytes(self.layout, 92))])
        assert n == 1
        assert as_bytes(backend.get(key(92))) == chunk_bytes(self.layout, 92)

    def test_unfull_chunk_kept_by_local_tiers(self, backend: StorageBackend) -> None:
        if self.refuses_unfull_chunks:
            pytest.skip("this backend refuses partial chunks (tested by test_unfull_chunk_refused)")
        data = chunk_bytes(self.layout, 93, 1000)
        backend.put(key(93), data)
        assert as_bytes(backend.get(key(93))) == data

    # ---- bounds -------------------------------------------------------------------------------------
    def test_lru_eviction_within_bound(self, request: pytest.FixtureRequest) -> None:
        if not self.bounded:
            pytest.skip("not a byte-bounded LRU tier (bounded = False)")
        full = self.layout.full_chunk_bytes
        b = self.make_bounded(4 * full, request)
        try:
            for i in range(4):
                b.put(key(100 + i), chunk_bytes(self.layout, 100 + i))
            assert b.get(key(100)) is not None  # 100 is now the most recently used
            b.put(key(104), chunk_bytes(self.layout, 104))
            assert b.get(key(101)) is None  # the least recently used went first
            for i in (100, 102, 103, 104):
                assert as_bytes(b.get(key(i))) == chunk_bytes(self.layout, i)
            assert b.used_bytes <= 4 * full  # type: ignore[attr-defined]
            assert b.peak_bytes <= 4 * full  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="larger than the whole"):
                b.put(key(105), chunk_bytes(self.layout, 105, 5 * full))
        finally:
            b.close()

    # ---- persistence ------------------------------------------------------------------------------
    def test_reopen_sees_acknowledged_chunks(self, backend: StorageBackend) -> None:
        if not self.supports_reopen:
            pytest.skip("the backend does not persist across instances (supports_reopen = False)")
        items = [(key(i), chunk_bytes(self.layout, i)) for i in range(110, 115)]
        backend.batched_put(items[:3])
        for k, d in items[3:]:
            backend.put(k, d, blocking=False)
        backend.close()  # drains the queued puts
        again = self.reopen(backend)
        try:
            assert sorted(again.list()) == sorted(k.to_string() for k, _ in items)
            assert [as_bytes(g) for g in again.batched_get([k for k, _ in items])] == [d for _, d in items]
        finally:
            again.close()

    # ---- concurrency ------------------------------------------------------------------------------
    def test_concurrent_writers_and_readers(self, backend: StorageBackend) -> None:
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for i in range(10):
                    k = key(200 + i)  # every thread writes the same keys, with the same bytes
                    backend.put(k, chunk_bytes(self.layout, 200 + i), blocking=bool(t % 2))
                    got = backend.get(k)
                    if got is not None and as_bytes(got) != chunk_bytes(self.layout, 200 + i):
                        raise AssertionError(f"thread {t} read a wrong chunk for {k}")
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        backend.flush()
        assert not errors, errors
        for i in range(10):
            assert as_bytes(backend.get(key(200 + i))) == chunk_bytes(self.layout, 200 + i)


__all__ = ["BackendTests", "as_bytes", "chunk_bytes", "key"]
