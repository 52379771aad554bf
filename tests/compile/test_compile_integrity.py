"""Entries fetched file by file are checked against their checksum records before they are installed.

Damage as a bucket can suffer it (a flipped byte, a truncated file, two entries' bodies swapped, a
broken record), on every store: the damaged entry is never installed, the rest are, the metric
counts the refusal, and a file that failed its sha256 is removed with its entry's marker so the
next sync republishes the entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbucket.compile_cache import NeuronLayout, fetch, sync
from kvbucket.compile_cache.sums import SUMS_PREFIX, sums_name
from kvbucket.metrics import integrity_failures
from kvbucket.stores.base import ObjectStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler

LAY = NeuronLayout(VERSION)
GRAPHS = ["g0", "g1", "g2"]


def _published(tmp_path: Path, store: ObjectStore) -> StandInCompiler:
    a = StandInCompiler(tmp_path / "a", VERSION)
    for g in GRAPHS:
        a.compile(g)
    rep = sync(store, LAY, a.cache_dir, packs=False)
    assert len(rep.transferred) == 3 and not rep.failed
    return a


def _neff(host: StandInCompiler, graph: str) -> str:
    return f"{host.module_dir(graph).relative_to(host.cache_dir).as_posix()}/model.neff"


def _entry(host: StandInCompiler, graph: str) -> str:
    return host.module_dir(graph).relative_to(host.cache_dir).as_posix()


def _names(store: ObjectStore) -> set[str]:
    return {o.name for o in store.list("")}


def test_sync_writes_one_record_per_entry_listing_every_file(store: CountingStore, tmp_path: Path) -> None:
    a = _published(tmp_path, store)
    sums = sorted(n for n in _names(store) if n.startswith(SUMS_PREFIX))
    assert sums == sorted(sums_name(LAY, _entry(a, g)) for g in GRAPHS)
    doc = json.loads(store.get(sums_name(LAY, _entry(a, "g1"))) or b"")
    entry_files = {p.relative_to(a.cache_dir).as_posix() for p in a.module_dir("g1").iterdir()}
    assert doc["entry"] == _entry(a, "g1") and set(doc["files"]) == entry_files
    assert doc["files"][_neff(a, "g1")][0] == a.neff_size


def test_a_flipped_byte_is_refused_removed_and_republished(store: CountingStore, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    a = _published(tmp_path, store)
    victim = _neff(a, "g1")
    data = bytearray(store.get(victim) or b"")
    data[len(data) // 2] ^= 0x01
    store.put(victim, bytes(data))
    before = integrity_failures("compile_cache", "checksum")

    b = StandInCompiler(tmp_path / "b", VERSION)
    rep = fetch(store, LAY, b.cache_dir, packs=False)
    assert sorted(rep.transferred) == sorted(_entry(a, g) for g in ("g0", "g2"))
    assert list(rep.failed) == [_entry(a, "g1")] and "sha256" in rep.failed[_entry(a, "g1")]
    assert not b.module_dir("g1").exists()
    assert not [p for p in b.cache_dir.rglob("*") if ".kvbucket-tmp" in p.name]
    assert integrity_failures("compile_cache", "checksum") == before + 1
    assert victim in caplog.text and bytes(data[:16]).hex() not in caplog.text
    names = _names(store)
    assert victim not in names and LAY.marker(_entry(a, "g1")) not in names  # the entry is incomplete now

    # host b compiles g1 itself; host a's next sync puts the entry back, intact
    rep = sync(store, LAY, a.cache_dir, packs=False)
    assert rep.transferred == [_entry(a, "g1")]
    c = StandInCompiler(tmp_path / "c", VERSION)
    rep = fetch(store, LAY, c.cache_dir, packs=False)
    assert len(rep.transferred) == 3 and not rep.failed and not rep.unverified
    neff = "model.neff"
    assert (c.module_dir("g1") / neff).read_bytes() == (a.module_dir("g1") / neff).read_bytes()


def test_swapped_bodies_of_two_entries_are_both_refused(local_store: CountingStore, tmp_path: Path) -> None:
    a = _published(tmp_path, local_store)
    n0, n2 = _neff(a, "g0"), _neff(a, "g2")
    d0, d2 = local_store.get(n0), local_store.get(n2)
    assert d0 and d2 and len(d0) == len(d2) and d0 != d2
    local_store.put_many([(n0, d2), (n2, d0)])
    rep = fetch(local_store, LAY, tmp_path / "b", packs=False)
    assert rep.transferred == [_entry(a, "g1")]
    assert sorted(rep.failed) == sorted([_entry(a, "g0"), _entry(a, "g2")])


@pytest.mark.parametrize("damage", ["truncated", "record-broken", "record-foreign", "extra-file"])
def test_entries_disagreeing_with_their_record_are_refused_before_download(
        local_store: CountingStore, tmp_path: Path, damage: str) -> None:
    a = _published(tmp_path, local_store)
    entry, victim = _entry(a, "g1"), _neff(a, "g1")
    reason = "mismatch"
    if damage == "truncated":
        local_store.put(victim, (local_store.get(victim) or b"")[:100])
        why = "bytes, its record says"
    elif damage == "record-broken":
        local_store.put(sums_name(LAY, entry), b"{not json")
        why, reason = "is not JSON", "record"
    elif damage == "record-foreign":  # another entry's record copied under this entry's name
        local_store.put(sums_name(LAY, entry), local_store.get(sums_name(LAY, _entry(a, "g0"))) or b"")
        why, reason = "not its own entry", "record"
    else:
        local_store.put(f"{entry}/planted.so", b"x" * 10)
        why = "extra"
    before = integrity_failures("compile_cache", reason)
    local_store.reset()
    rep = fetch(local_store, LAY, tmp_path / "b", packs=False)
    assert list(rep.failed) == [entry] and why in rep.failed[entry], rep.failed
    assert len(rep.transferred) == 2 and not (tmp_path / "b" / entry).exists()
    assert integrity_failures("compile_cache", reason) == before + 1
    # refused from the listing and the record: none of its files was downloaded
    assert local_store.items["get"] == 3 + 2 * 3, local_store.items  # 3 records, g0 and g2's 3 files each
    assert victim in _names(local_store)  # nothing proves the bytes bad: left for a sync to fix


def test_entries_without_a_record_are_fetched_by_size_and_reported_unverified(
        local_store: CountingStore, tmp_path: Path) -> None:
    a = _published(tmp_path, local_store)
    local_store.delete_many([n for n in _names(local_store) if n.startswith(SUMS_PREFIX)])
    rep = fetch(local_store, LAY, tmp_path / "b", packs=False)
    assert len(rep.transferred) == 3 and sorted(rep.unverified) == sorted(rep.transferred)
    assert "3 without checksum record" in rep.summary()
    assert (tmp_path / "b" / _neff(a, "g2")).read_bytes() == (a.module_dir("g2") / "model.neff").read_bytes()


def test_a_record_that_does_not_land_keeps_the_entry_unpublished(local_store: CountingStore,
                                                                 tmp_path: Path) -> None:
    from kvbucket.errors import StoreError
    from kvbucket.stores.base import ItemResult

    class RefusesRecords(CountingStore):
        def put_many(self, items: Any) -> Any:
            items = list(items)
            good = [(n, d) for n, d in items if not n.startswith(SUMS_PREFIX)]
            results = {r.name: r for r in super().put_many(good)}
            return [results.get(n) or ItemResult(n, error=StoreError("503 slow down")) for n, _ in items]

    a = StandInCompiler(tmp_path / "a", VERSION)
    a.compile("g0")
    rep = sync(RefusesRecords(local_store), LAY, a.cache_dir, packs=False)
    assert rep.transferred == [] and "503 slow down" in rep.failed[_entry(a, "g0")]
    assert LAY.marker(_entry(a, "g0")) not in _names(local_store)  # fetch ignores the entry
    assert fetch(local_store, LAY, tmp_path / "b").transferred == []
