"""Everything under ``_fleet/`` is untrusted input (issue 24 items 6 and 11): a snapshot, digest or
journal that does not parse is skipped and quarantined (counted, read once), never stops a round,
and a garbage snapshot at a high generation does not shadow the good ones. On a directory, S3
(SeaweedFS) and the Hub emulator, with fleet members driven round by round (``sync_once``)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvbucket.fleet.layout import digest_name, journal_name
from kvbucket.fleet.wire import MAX_DECODED
from kvbucket.stores.base import Buffer, ItemResult, ObjectStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.fleet_rounds import CHUNK, FAST, GARBAGE, P, member, open_store, rounds, stored


@pytest.mark.parametrize("kind", ["file", "s3", "hub"])
@pytest.mark.parametrize("where", ["s/0-n9", "s/999999999-zz", "d"])
def test_one_garbage_file_under_fleet_does_not_stop_any_round(kind: str, where: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    store = open_store(kind, request, tmp_path)
    store.put(f"{P}/_fleet/{where}", GARBAGE)
    a, b = member(store, "n0"), member(store, "n1")
    try:
        stored(store, a, range(12))  # over the 80% watermark of 10 chunks
        rounds(a, b)
        store.put(f"{P}/_fleet/{where}", GARBAGE)  # again, now that b reads the digest a writes
        b.sync_once()
        time.sleep(FAST["compact_secs"])
        rounds(a, b)  # a compacts: a snapshot and a digest naming it
        for f in (a, b):
            s = f.status()
            assert s["sync_errors"] == 0 and s["last_error"] is None, s
            assert s["chunks"] == 12 and s["bytes_used"] == 12 * CHUNK  # b learned a's chunks
        assert a.status()["snapshot_generation"] >= 1 and a.status()["snapshots_written"] >= 1
        # Eviction runs: the two nodes' shares of the victims bring the prefix to the target.
        victims = a.victims(()) + b.victims(())
        assert len(victims) == len(set(victims)) >= 12 - 6
        assert sum(f.status()["quarantined"] for f in (a, b)) >= 1  # judged bad, counted
        # A node joining now, with garbage at a high generation and in place of the digest, still
        # starts from the good snapshot (the garbage does not shadow it) and sees every chunk.
        store.put(f"{P}/_fleet/s/999999999999-zz", GARBAGE)
        store.put(digest_name(P), GARBAGE)
        c = member(store, "n2")
        c.sync_once()
        s = c.status()
        assert s["chunks"] == 12 and s["sync_errors"] == 0, s
        assert 1 <= s["snapshot_generation"] < 999999999999 and s["quarantined"] >= 1
        c.close()
    finally:
        a.close()
        b.close()
        store.close()


class _GetLog(CountingStore):
    """Records which names were read (to see a bad object read once, not every round)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.read: list[str] = []

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        self.read += names
        return super().get_many(names, out)


def zlib_bomb(decoded: int) -> bytes:
    """``decoded`` zero bytes, compressed (1 KiB per MiB) without holding them in memory."""
    z = zlib.compressobj(9)
    block = bytes(1 << 20)
    parts = [z.compress(block) for _ in range(decoded >> 20)]
    return b"".join(parts) + z.flush()


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_zlib_bomb_journal_is_read_once_and_never_inflated_in_full(kind: str, tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    import tracemalloc

    inner = open_store(kind, request, tmp_path)
    bomb = zlib_bomb(256 << 20)  # 256 KiB that inflate to 256 MiB
    bad, junk = journal_name(P, "evil", 1), journal_name(P, "evil", 2)
    inner.put(bad, bomb)
    inner.put(junk, GARBAGE)
    store = _GetLog(inner)
    a, b = member(store, "n0"), member(inner, "n1")
    try:
        stored(inner, b, range(3))
        tracemalloc.start()
        try:
            rounds(a, b, n=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # Inflated up to the journal's bound, never in full (256 MiB; today's main peaked at 557).
        assert peak < 3 * MAX_DECODED["journal"] < 128 << 20, f"peak {peak >> 20} MiB for a skipped bomb"
        assert store.read.count(bad) <= 1 and store.read.count(junk) == 1, store.read
        s = a.status()
        assert s["quarantined"] == 2 and s["sync_errors"] == 0 and s["chunks"] == 3, s
    finally:
        a.close()
        b.close()
        inner.close()


def test_a_digest_with_one_bad_field_is_refused_whole() -> None:
    """Every field is checked before anything is folded: one wrong row, a NaN time or a mark
    that is not a number refuses the object (it used to raise half-way through folding it)."""
    from kvbucket.fleet.layout import encode
    from kvbucket.fleet.wire import BadObject, inflate, read_digest

    ok = {"gen": 0, "snode": "n0", "t": 1.0, "node": "n0", "e": [["seg", 10, 1.0, 2.0, "n0"]],
          "tomb": [["gone", 3.0]], "marks": {"n1": 4}}
    assert read_digest(encode("digest", ok))["e"] == [("seg", 10, 1.0, 2.0, "n0")]
    for bad in ({"e": ok["e"] + [["seg2", "ten", 1.0, 2.0, "n0"]]}, {"t": float("nan")},
                {"marks": {"n1": "4"}}, {"tomb": [["gone"]]}, {"e": "rows"}, {"gen": True},
                {"snode": ["n0"]}, {"seen": {"n1": 1e300}}):
        with pytest.raises(BadObject):
            read_digest(encode("digest", {**ok, **bad}))
    with pytest.raises(BadObject, match="not a fleet digest"):
        read_digest(encode("journal", ok))
    with pytest.raises(BadObject, match="inflates past"):
        inflate("journal", zlib_bomb(MAX_DECODED["journal"] + (1 << 20)))
