"""A load that arrives while its read-ahead is on its way takes the read's destination
(``Scatter.redirect``): the bytes still to come land in the load's buffer, those already landed
are copied once, and nothing is copied after the read. Only stores that write through
``dst[a:b] = data`` (``redirectable_reads``) are redirected. Counts, never times."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvbucket.stores.base import Buffer, ItemResult, Scatter
from kvbucket.stores.guard.read_ahead import PrefetchStore
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore

SIZE = 64 * 1024


def test_a_redirect_copies_what_landed_and_moves_the_rest() -> None:
    old, new = bytearray(SIZE), bytearray(SIZE)
    dst = Scatter(bytearray(8), old)
    data = os.urandom(8 + SIZE)
    with pytest.raises(RuntimeError, match="allow_redirect"):
        dst.redirect(1, memoryview(new))
    dst.allow_redirect()
    dst[0:1000] = data[:1000]
    assert dst.redirect(1, memoryview(new)) == 1000 - 8  # the payload bytes that had landed
    dst[1000 : 8 + SIZE] = data[1000:]
    assert bytes(dst.parts[0]) + bytes(new) == data
    assert bytes(old[992:]) == bytes(SIZE - 992)  # nothing after the redirect went to the old part
    with pytest.raises(ValueError, match="needs"):
        dst.redirect(1, memoryview(bytearray(SIZE + 1)))


class HeldStore(CountingStore):
    """Writes each object in two halves (``dst[a:b] = data``), pausing between them until
    released: the first half lands before the load when ``first_half_early``."""

    redirectable_reads = True

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.started = threading.Event()
        self.half = threading.Event()
        self.release = threading.Event()
        self.first_half_early = False
        self.fail = False

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        whole = super().get_many(names)
        if out is None:
            return whole
        self.started.set()
        if not self.first_half_early:
            assert self.release.wait(10)
        for r, dst in zip(whole, out, strict=True):
            assert r.data is not None and dst is not None
            data, n = bytes(r.data), len(r.data) // 2
            dst[0:n] = data[:n]  # type: ignore[index]
        self.half.set()
        assert self.release.wait(10)
        results = []
        for r, dst in zip(whole, out, strict=True):
            assert r.data is not None
            data, n = bytes(r.data), len(r.data) // 2
            dst[n : len(data)] = data[n:]  # type: ignore[index]
            results.append(ItemResult(r.name, error=OSError("lost")) if self.fail else
                           ItemResult(r.name, size=len(data), data=dst))
        self.fail = False
        return results


def setup(n: int) -> tuple[HeldStore, PrefetchStore, list[str], list[bytes]]:
    raw = HeldStore()
    sealed = seal_store(raw, tier="l2")
    names = [f"k{i}" for i in range(n)]
    data = [os.urandom(SIZE) for _ in names]
    assert all(r.ok for r in sealed.put_many(list(zip(names, data, strict=True))))
    raw.reset()
    return raw, PrefetchStore(sealed, ReadAheadSettings(True, 64 * SIZE, 10.0), label="redirect"), names, data


def load_while_held(pf: PrefetchStore, raw: HeldStore, names: list[str]
                    ) -> tuple[list[ItemResult], list[bytes]]:
    bufs = [np.zeros(SIZE, np.uint8) for _ in names]
    got: list[ItemResult] = []
    t = threading.Thread(target=lambda: got.extend(pf.get_many(names, bufs)))
    t.start()
    while pf.redirected < len(names) and t.is_alive():
        threading.Event().wait(0.005)
    raw.release.set()
    t.join(10)
    return got, [b.tobytes() for b in bufs]


@pytest.mark.parametrize("first_half_early", [False, True])
def test_a_load_during_the_read_ahead_takes_its_destination(first_half_early: bool) -> None:
    raw, pf, names, data = setup(4)
    raw.first_half_early = first_half_early
    try:
        assert pf.redirects
        assert pf.prefetch(names, [SIZE] * 4) == 4 * SIZE
        assert (raw.half if first_half_early else raw.started).wait(10)
        got, bytes_out = load_while_held(pf, raw, names)
        assert [r.size for r in got] == [SIZE] * 4 and bytes_out == data
        assert pf.redirected == 4
        # Nothing landed before the load: nothing copied; half landed: that half copied, once
        # (the half of each sealed object, minus its 64-byte header), and never the rest.
        half = (SIZE + 64) // 2 - 64
        assert pf.redirect_copied == (4 * half if first_half_early else 0)
        assert raw.calls["get"] == 1  # the read-ahead's one read: the load asked nothing
        assert pf.held_bytes == 0 and pf.pooled_bytes == 4 * SIZE  # recycled, as after a copy
    finally:
        pf.close()


def test_a_redirected_read_ahead_that_fails_is_read_again_by_the_load() -> None:
    raw, pf, names, data = setup(3)
    raw.fail = True
    try:
        assert pf.prefetch(names, [SIZE] * 3) == 3 * SIZE
        assert raw.started.wait(10)
        got, bytes_out = load_while_held(pf, raw, names)
        assert [r.size for r in got] == [SIZE] * 3 and bytes_out == data
        assert pf.redirected == 3
        assert raw.calls["get"] == 2  # the failed read-ahead, then the load's own read
    finally:
        pf.close()


def test_stores_that_lend_their_memory_are_not_redirected() -> None:
    raw = CountingStore(MemoryStore())  # no redirectable_reads: copied after the read, as before
    names = ["a", "b"]
    data = [os.urandom(SIZE) for _ in names]
    raw.put_many(list(zip(names, data, strict=True)))
    pf = PrefetchStore(raw, ReadAheadSettings(True, 64 * SIZE, 10.0), label="no-redirect")
    try:
        assert not pf.redirects
        pf.prefetch(names, [SIZE] * 2)
        bufs = [np.zeros(SIZE, np.uint8) for _ in names]
        assert all(r.found for r in pf.get_many(names, bufs))
        assert [b.tobytes() for b in bufs] == data and pf.redirected == 0
    finally:
        pf.close()


def test_a_load_arriving_while_its_read_ahead_is_decrypted_gets_plaintext(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    """Issue 29 item 1: the read has landed and is being decrypted in place when the load comes.
    A redirect then would copy ciphertext into the load's buffer (and decryption go on in the
    read-ahead's own buffer): the load must get the plaintext, or a miss, never ciphertext."""
    from kvbucket.encryption import Keyring
    from kvbucket.stores.guard import envelope_open
    raw = HeldStore()
    raw.first_half_early = True
    raw.release.set()  # the store writes everything at once: the read is over before the load
    sealed = seal_store(raw, tier="l2", encryption=Keyring({"*": {1: os.urandom(32)}}))
    names = ["a", "b"]
    data = [os.urandom(SIZE) for _ in names]
    assert all(r.ok for r in sealed.put_many(list(zip(names, data, strict=True))))
    pf = PrefetchStore(sealed, ReadAheadSettings(True, 64 * SIZE, 10.0), label="decrypting")
    decrypting, redirect_tried = threading.Event(), threading.Event()
    real_decrypt, real_redirect = envelope_open.decrypt_in_place, pf._redirect

    def decrypt(*args: object, **kw: object) -> None:  # the read-ahead's decryption: held until the load came
        decrypting.set()
        redirect_tried.wait(10)
        real_decrypt(*args, **kw)  # type: ignore[arg-type]

    def redirect(*args: object) -> None:
        try:
            real_redirect(*args)  # type: ignore[arg-type]
        finally:
            redirect_tried.set()

    monkeypatch.setattr(envelope_open, "decrypt_in_place", decrypt)
    monkeypatch.setattr(pf, "_redirect", redirect)
    try:
        assert pf.redirects and pf.prefetch(names, [SIZE] * 2) == 2 * SIZE
        assert decrypting.wait(10)
        bufs = [np.zeros(SIZE, np.uint8) for _ in names]
        got = pf.get_many(names, bufs)
        for r, b, d in zip(got, bufs, data, strict=True):
            assert not r.found or b.tobytes() == d, "a found=True result carries other bytes (ciphertext)"
        assert [r.found for r in got] == [True, True]  # served (copied from the decrypted read-ahead)
        assert raw.calls["get"] == 1  # the read-ahead's read only
    finally:
        pf.close()
