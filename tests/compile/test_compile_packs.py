"""Pack objects of the compile cache: round trip, partial uploads, corruption, concurrency, hostile names."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbucket.compile_cache import NeuronLayout, compile_cache, fetch, sync
from kvbucket.compile_cache.packs import PACKS_PREFIX, PackError, parse_index
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler

GROUP = f"neuronxcc-{VERSION}"
LAY = NeuronLayout(VERSION)
GRAPHS = [f"g{i}" for i in range(12)]


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if kind == "memory":
        return MemoryStore("cpack")
    if kind == "file":
        return FileStore(tmp_path / "bucket")
    from kvbucket.stores.hub.open import open_hfbucket_store

    bucket = request.getfixturevalue("hub_bucket")
    return open_hfbucket_store(f"hf://buckets/{bucket.bucket_id}/cc", endpoint=bucket.hub.endpoint,
                               token=bucket.hub.write_token, token_env="")


@pytest.fixture(params=["memory", "file", "hf"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingStore]:
    """memory/FileStore, and the Hub emulator driven by the unmodified huggingface_hub/hf_xet."""
    s = CountingStore(_open(request.param, request, tmp_path))
    yield s
    s.close()


def _host(tmp_path: Path, name: str, graphs: list[str] = GRAPHS) -> StandInCompiler:
    h = StandInCompiler(tmp_path / name, VERSION)
    for g in graphs:
        h.compile(g)
    return h


def _packs(store: ObjectStore) -> list[str]:
    return sorted(o.name for o in store.list(PACKS_PREFIX))


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.startswith(".kvbucket")}


def test_pack_round_trip_takes_every_entry_from_one_pack(store: CountingStore, tmp_path: Path) -> None:
    a = _host(tmp_path, "a")
    rep = sync(store, LAY, a.cache_dir)
    assert len(rep.transferred) == 12 and rep.packs == 1 and rep.pack_entries == 12 and not rep.pack_errors
    packs = _packs(store)
    assert [n.rsplit(".", 1)[1] for n in packs] == ["json", "pack"]
    assert all(n.startswith(f"{PACKS_PREFIX}neuron/{GROUP}/flat/") for n in packs)
    digest = packs[1].rsplit("/", 1)[1].removesuffix(".pack")
    assert hashlib.sha256(store.get(packs[1]) or b"").hexdigest() == digest  # content-addressed

    b = StandInCompiler(tmp_path / "b", VERSION)
    store.reset()
    rep = fetch(store, LAY, b.cache_dir)
    assert sorted(rep.transferred) == sorted(e.name for e in LAY.scan(a.cache_dir))
    assert rep.packs == 1 and rep.pack_entries == 12 and rep.files == 48 and not rep.failed
    # one listing of the flat area, one of the packs, then the index and the pack: 2 object reads
    assert store.calls["list"] == 2 and store.items["get"] == 2, store.calls
    assert _tree(b.cache_dir) == _tree(a.cache_dir)
    for g in GRAPHS:
        b.compile(g)
    assert b.compilations == 0 and b.cache_hits == 12
    assert not [p for p in b.cache_dir.rglob("*") if ".kvbucket-tmp" in p.name]


def test_model_scoped_packs_live_in_the_model_area(local_store: CountingStore, tmp_path: Path) -> None:
    a, b = StandInCompiler(tmp_path / "a", VERSION), StandInCompiler(tmp_path / "b", VERSION)
    kw: dict[str, Any] = {"model_id": "org/model", "task": "text-generation",
                          "export_config": {"tp_degree": 2}, "version": VERSION}
    with compile_cache(target=local_store, cache_dir=a.cache_dir, **kw):
        for g in GRAPHS[:4]:
            a.compile(g)
    packs = _packs(local_store)
    assert len(packs) == 2 and all(f"/{GROUP}/org/model/text-generation/" in n for n in packs), packs
    with compile_cache(target=local_store, cache_dir=b.cache_dir, **kw) as s:
        for g in GRAPHS[:4]:
            b.compile(g)
    assert s.fetched is not None and s.fetched.pack_entries == 4
    assert b.compilations == 0


def test_a_pack_without_its_index_is_ignored(local_store: CountingStore, tmp_path: Path) -> None:
    a = _host(tmp_path, "a")
    sync(local_store, LAY, a.cache_dir)
    index = [n for n in _packs(local_store) if n.endswith(".json")]
    local_store.delete(index[0])  # as if the sync died after the pack, before its completion record
    rep = fetch(local_store, LAY, tmp_path / "b")
    assert rep.packs == 0 and len(rep.transferred) == 12 and rep.files == 48 and not rep.pack_errors
    assert _tree(tmp_path / "b") == _tree(a.cache_dir)


def test_an_interrupted_pack_upload_leaves_no_index_and_the_next_sync_packs(local_store: CountingStore,
                                                                           tmp_path: Path) -> None:
    class DiesOnIndexes(CountingStore):
        def put_many(self, items: Any) -> Any:
            if any(n.endswith(".json") and n.startswith(PACKS_PREFIX) for n, _ in items):
                raise KeyboardInterrupt("killed before the index")
            return super().put_many(items)

    a = _host(tmp_path, "a")
    with pytest.raises(KeyboardInterrupt):
        sync(DiesOnIndexes(local_store), LAY, a.cache_dir)
    assert [n for n in _packs(local_store) if n.endswith(".pack")]
    assert not [n for n in _packs(local_store) if n.endswith(".json")]
    rep = fetch(local_store, LAY, tmp_path / "b")
    assert rep.packs == 0 and len(rep.transferred) == 12


def test_a_corrupted_pack_member_is_refused_and_fetched_per_file(store: CountingStore, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    a = _host(tmp_path, "a")
    sync(store, LAY, a.cache_dir)
    index_name, pack_name = _packs(store)
    index = json.loads(store.get(index_name) or b"")
    victim = sorted(index["entries"])[3]
    neff = f"{victim}/model.neff"
    off, size, _ = index["entries"][victim][neff]
    data = bytearray(store.get(pack_name) or b"")
    data[off + size // 2] ^= 0xFF
    store.put(pack_name, bytes(data))

    b = tmp_path / "b"
    rep = fetch(store, LAY, b)
    assert len(rep.transferred) == 12 and not rep.failed
    assert rep.pack_entries == 11 and len(rep.pack_errors) == 1
    assert neff in rep.pack_errors[0] and "does not match its sha256" in rep.pack_errors[0]
    assert "file by file" in caplog.text
    assert _tree(b) == _tree(a.cache_dir)  # the victim came from the flat area, intact


def test_two_hosts_syncing_at_once_write_their_own_packs_and_fetch_takes_the_union(
        local_store: CountingStore, tmp_path: Path) -> None:
    a = _host(tmp_path, "a", GRAPHS[:8])
    b = _host(tmp_path, "b", GRAPHS[4:])  # g4..g7 compiled on both hosts: same entries
    barrier = threading.Barrier(2)
    reports: dict[str, Any] = {}

    def run(name: str, h: StandInCompiler) -> None:
        barrier.wait()
        reports[name] = sync(local_store, LAY, h.cache_dir)

    threads = [threading.Thread(target=run, args=(n, h)) for n, h in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not reports["a"].failed and not reports["b"].failed
    packs = [n for n in _packs(local_store) if n.endswith(".pack")]
    assert 1 <= len(packs) <= 2 and reports["a"].packs + reports["b"].packs >= 1
    c = tmp_path / "c"
    rep = fetch(local_store, LAY, c)
    assert len(rep.transferred) == len(set(rep.transferred)) == 12 and not rep.failed
    assert _tree(c) == {**_tree(a.cache_dir), **_tree(b.cache_dir)}


def test_hostile_pack_indexes_are_refused_and_nothing_lands_outside_the_cache(
        local_store: CountingStore, tmp_path: Path) -> None:
    a = _host(tmp_path, "a", GRAPHS[:2])
    sync(local_store, LAY, a.cache_dir, packs=False)
    entries = sorted(e.name for e in LAY.scan(a.cache_dir))
    payload = b"EVIL" * 16
    sha = hashlib.sha256(payload).hexdigest()
    folder = f"{PACKS_PREFIX}neuron/{GROUP}/flat/"
    hostile = {
        "climbs": {entries[0]: {f"{entries[0]}/../../../evil": [0, 64, sha]}},
        "other-entry": {entries[0]: {f"{entries[1]}/model.neff": [0, 64, sha]}},
        "absolute": {entries[0]: {"/tmp/evil": [0, 64, sha]}},
        "past-the-end": {entries[0]: {f"{entries[0]}/model.neff": [32, 64, sha]}},
    }
    for i, (_why, ents) in enumerate(sorted(hostile.items())):
        pid = f"{i:064x}"
        local_store.put(f"{folder}{pid}.pack", payload)
        doc = {"format": "kvbucket-pack/1", "pack": f"{pid}.pack", "size": 64, "sha256": sha, "entries": ents}
        local_store.put(f"{folder}{pid}.json", json.dumps(doc).encode())
    dest = tmp_path / "dest" / "cache"
    rep = fetch(local_store, LAY, dest)
    assert len(rep.pack_errors) == 4 and rep.packs == 0, rep.pack_errors
    assert sorted(rep.transferred) == entries and _tree(dest) == _tree(a.cache_dir)
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["cache"]
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize(("files", "why"), [
    ({"E/../x": [0, 1, "0" * 64]}, "unsafe file"),
    ({"E/model.neff": [0, 1, "nothex"]}, "bad range or sha256"),
    ({"E/model.neff": [-1, 1, "0" * 64]}, "bad range or sha256"),
    ({"neuronxcc-9/MODULE_b+c/model.neff": [0, 1, "0" * 64]}, "not inside its entry"),
])
def test_parse_index_says_what_is_wrong(files: dict[str, Any], why: str) -> None:
    entry = f"{GROUP}/MODULE_a+b"
    files = {k.replace("E/", f"{entry}/", 1): v for k, v in files.items()}
    name = f"{PACKS_PREFIX}neuron/{GROUP}/flat/{'0' * 64}.json"
    doc = {"format": "kvbucket-pack/1", "pack": f"{'0' * 64}.pack", "size": 10, "entries": {entry: files}}
    with pytest.raises(PackError, match=why):
        parse_index(LAY, name, json.dumps(doc).encode(), 10)
    with pytest.raises(PackError, match="store lists 11"):
        parse_index(LAY, name, json.dumps(doc).encode(), 11)
