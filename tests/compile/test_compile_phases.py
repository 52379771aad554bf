"""The seed's phases, and every defect its review found, played with a stand-in Neuron compiler."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvbucket.compile_cache import NeuronLayout, compile_cache, fetch, lookup, sync
from kvbucket.compile_cache.transfer import ModelScope
from kvbucket.errors import TransientStoreError
from kvbucket.stores.base import Buffer, ItemResult, ObjectStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import CompileFailed, StandInCompiler

GROUP = f"neuronxcc-{VERSION}"

MODEL = "meta-llama/Llama-3.2-1B"
TASK = "text-generation"
CONFIG = {"tp_degree": 2, "torch_dtype": "bfloat16", "batch_size": 1, "sequence_length": 4096}
GRAPHS = ["embed", "layer0", "layer1", "lm_head"]


def _cc(host: StandInCompiler, store: ObjectStore, **kw: object):  # type: ignore[no-untyped-def]
    return compile_cache(target=store, cache_dir=host.cache_dir, version=VERSION, **kw)  # type: ignore[arg-type]


def _names(store: ObjectStore, prefix: str = "") -> list[str]:
    return [o.name for o in store.list(prefix)]


def _entries_in_bucket(store: ObjectStore) -> set[str]:
    lay = NeuronLayout(VERSION)
    return {e for n in _names(store) if (e := lay.entry_of(n))}


def test_phases_compile_sync_fetch_warm(store: CountingStore, host_a: StandInCompiler,
                                        host_b: StandInCompiler) -> None:
    # phase 1: compile and sync
    with _cc(host_a, store, model_id=MODEL, task=TASK, export_config=CONFIG) as s:
        for g in GRAPHS:
            host_a.compile(g)
    assert host_a.compilations == 4
    assert s.synced is not None and len(s.synced.transferred) == 4 and not s.synced.failed
    assert s.synced.records == 1
    assert len(_entries_in_bucket(store)) == 4
    refs = _names(store, f"{GROUP}/meta-llama/Llama-3.2-1B/{TASK}/")
    assert len(refs) == 4

    # phase 2: another machine with an empty cache fetches, then compiles nothing
    with _cc(host_b, store, model_id=MODEL, task=TASK, export_config=CONFIG) as s:
        assert s.fetched is not None and len(s.fetched.transferred) == 4
        for g in GRAPHS:
            assert host_b.compile(g) == host_a.compile(g)
    assert host_b.compilations == 0 and host_b.cache_hits == 4
    assert s.synced is not None and s.synced.transferred == [] and len(s.synced.skipped) == 4

    # phase 3: warm cache: no object moves in either direction
    store.reset()
    with _cc(host_b, store, model_id=MODEL, task=TASK, export_config=CONFIG) as s:
        for g in GRAPHS:
            host_b.compile(g)
    assert host_b.compilations == 0
    assert store.items["put"] == 0 and store.items["get"] == 0
    assert s.fetched is not None and s.fetched.transferred == [] and s.fetched.files == 0
    assert s.synced is not None and s.synced.files == 0


def test_failed_locked_and_partial_entries_never_leave_the_host(store: CountingStore, host_a: StandInCompiler,
                                                                host_b: StandInCompiler) -> None:
    with _cc(host_a, store, model_id=MODEL, task=TASK) as s:
        host_a.compile("good")
        with pytest.raises(CompileFailed):
            host_a.compile("bad", fail=True)
        host_a.compile("dies", crash=True)  # leaves a lock and no neff
    assert s.synced is not None
    assert s.synced.held_back == {"failed": 1, "in_progress": 1}
    names = _names(store)
    assert not [n for n in names if n.endswith((".lock", "model.log"))]
    assert _entries_in_bucket(store) == {host_a.module_dir("good").relative_to(host_a.cache_dir).as_posix()}

    with _cc(host_b, store, model_id=MODEL, task=TASK):
        host_b.compile("good")
        host_b.compile("bad")  # compiles for real instead of failing on a poisoned cache
        host_b.compile("dies")  # no inherited lock to wait on
    assert host_b.compilations == 2 and host_b.cache_hits == 1


def test_entries_compiled_before_the_block_are_published(store: CountingStore,
                                                         host_a: StandInCompiler) -> None:
    host_a.compile("early")  # outside any block: the seed never uploaded these
    with _cc(host_a, store) as s:
        host_a.compile("inside")
    assert s.synced is not None and len(s.synced.transferred) == 2


def test_without_model_id_only_the_flat_area_is_written(store: CountingStore, host_a: StandInCompiler,
                                                        host_b: StandInCompiler) -> None:
    with _cc(host_a, store):
        host_a.compile("g")
    packs = [n for n in _names(store) if n.startswith(".kvbucket/packs/")]
    assert packs and all(n.startswith(f".kvbucket/packs/neuron/{GROUP}/flat/") for n in packs), packs
    sums = [n for n in _names(store) if n.startswith(".kvbucket/sums/")]
    assert len(sums) == 1 and sums[0].startswith(f".kvbucket/sums/neuron/{GROUP}/MODULE_"), sums
    names = [n for n in _names(store) if n not in packs + sums]
    assert names and all(n.startswith(f"{GROUP}/MODULE_") for n in names), names
    assert not [n for n in names if "unknown" in n or "default" in n]
    with _cc(host_b, store) as s:
        host_b.compile("g")
    assert s.fetched is not None and len(s.fetched.transferred) == 1 and host_b.compilations == 0


class _InterruptingStore(CountingStore):
    """Dies on the n-th put_many call, like a process killed in the middle of a sync."""

    def __init__(self, inner: ObjectStore, die_on_put: int) -> None:
        super().__init__(inner)
        self.die_on_put = die_on_put

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        if self.calls["put"] + 1 == self.die_on_put:
            self.calls["put"] += 1
            raise KeyboardInterrupt("killed during sync")
        return super().put_many(items)


def test_interrupted_sync_is_ignored_by_fetch_and_completed_by_the_next_sync(
        store: CountingStore, host_a: StandInCompiler, host_b: StandInCompiler) -> None:
    lay = NeuronLayout(VERSION)
    for g in GRAPHS:
        host_a.compile(g)
    dying = _InterruptingStore(store, die_on_put=2)  # data files land, markers never do
    with pytest.raises(KeyboardInterrupt):
        sync(dying, lay, host_a.cache_dir)
    names = _names(store)
    assert any(n.endswith("model.neff") for n in names)
    assert not any(n.endswith("model.done") for n in names)

    rep = fetch(store, lay, host_b.cache_dir)
    assert rep.transferred == [] and not (host_b.cache_dir / GROUP).exists()

    store.reset()
    rep = sync(store, lay, host_a.cache_dir)
    assert len(rep.transferred) == 4
    # only the four markers were missing (+ the checksum records, written again before them, the
    # pack, which rode with the markers, and its index)
    assert rep.files == 4 and store.items["put"] == 4 + 4 + 2 and rep.packs == 1
    assert len(fetch(store, lay, host_b.cache_dir).transferred) == 4
    for g in GRAPHS:
        host_b.compile(g)
    assert host_b.compilations == 0


def test_concurrent_syncs_from_two_hosts_leave_a_consistent_bucket(store: CountingStore,
                                                                   tmp_path: Path) -> None:
    hosts = [StandInCompiler(tmp_path / f"h{i}", VERSION) for i in range(2)]
    shared = [f"shared{i}" for i in range(20)]
    errors: list[BaseException] = []

    def run(h: StandInCompiler, own: str) -> None:
        try:
            with _cc(h, store, model_id=MODEL, task=TASK, export_config=CONFIG):
                for g in [*shared, *(f"{own}{i}" for i in range(20))]:
                    h.compile(g)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(h, f"own{i}-")) for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    lay = NeuronLayout(VERSION)
    names = set(_names(store))
    entries = _entries_in_bucket(store)
    assert len(entries) == 60
    assert all(lay.remote_complete(e, names) for e in entries)
    assert all(f"{e}/model.hlo_module.pb" in names for e in entries)
    assert not [n for n in names if n.endswith((".lock", "model.log"))]
    third = StandInCompiler(tmp_path / "h3", VERSION)
    with _cc(third, store, model_id=MODEL, task=TASK, export_config=CONFIG):
        for g in [*shared, *(f"own0-{i}" for i in range(20)), *(f"own1-{i}" for i in range(20))]:
            third.compile(g)
    assert third.compilations == 0


def test_lookup_finds_records_across_key_name_variants(store: CountingStore, host_a: StandInCompiler) -> None:
    with _cc(host_a, store, model_id=MODEL, task=TASK, export_config=CONFIG):
        host_a.compile("g")
    other = {"tensor_parallel_size": 8, "dtype": "fp16", "max_batch_size": 4, "max_model_len": 2048}
    with _cc(host_a, store, model_id=MODEL, task=TASK, export_config=other):
        host_a.compile("g8")
    # vLLM's names and spellings find optimum-neuron's record
    vllm = {"tensor_parallel_size": "2", "dtype": "bf16", "max_num_seqs": "1", "max_model_len": "4096"}
    found = lookup(store, MODEL, filters=vllm)
    assert [r.config["tensor_parallel_size"] for r in found] == [2]
    assert found[0].config["dtype"] == "bfloat16" and found[0].group == GROUP
    assert len(lookup(store, MODEL)) == 2
    assert len(lookup(store, MODEL, task=TASK, group=GROUP, filters={"tp_degree": 8})) == 1
    assert lookup(store, MODEL, filters={"torch_dtype": "float32"}) == []
    assert lookup(store, "meta-llama/other") == []


def test_model_scoped_fetch_takes_only_that_model(store: CountingStore, host_a: StandInCompiler,
                                                  host_b: StandInCompiler) -> None:
    with _cc(host_a, store, model_id="org/a", task=TASK):
        host_a.compile("a1")
        host_a.compile("a2")
    with _cc(host_a, store, model_id="org/b", task=TASK):
        host_a.compile("b1")
    with _cc(host_b, store, model_id="org/b", task=TASK) as s:
        host_b.compile("b1")
    assert s.fetched is not None and len(s.fetched.transferred) == 1 and host_b.compilations == 0


def test_fetch_replaces_failed_local_entries_and_leaves_locked_ones(store: CountingStore,
                                                                   host_a: StandInCompiler,
                                                                   host_b: StandInCompiler) -> None:
    for g in ("x", "y"):
        host_a.compile(g)
    sync(store, NeuronLayout(VERSION), host_a.cache_dir)
    with pytest.raises(CompileFailed):
        host_b.compile("x", fail=True)
    host_b.compile("y", crash=True)
    rep = fetch(store, NeuronLayout(VERSION), host_b.cache_dir)
    assert rep.transferred == [host_a.module_dir("x").relative_to(host_a.cache_dir).as_posix()]
    assert host_b.compile("x") == host_a.compile("x")
    assert (host_b.module_dir("y") / "model.hlo_module.pb.lock").exists()
    assert not [p for p in host_b.cache_dir.rglob("*") if ".kvbucket-tmp" in p.name]


class _FailingGetStore(CountingStore):
    """Returns a per-item error for one object, like a dropped download."""

    def __init__(self, inner: ObjectStore, bad_suffix: str) -> None:
        super().__init__(inner)
        self.bad_suffix = bad_suffix

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        res = super().get_many(names, out)
        return [ItemResult(r.name, error=TransientStoreError("connection reset")) if r.name.endswith(
            self.bad_suffix) else r for r in res]


def test_a_failed_download_leaves_no_entry_behind(store: CountingStore, host_a: StandInCompiler,
                                                  host_b: StandInCompiler) -> None:
    host_a.compile("z")
    host_a.compile("w")
    sync(store, NeuronLayout(VERSION), host_a.cache_dir)
    bad = host_a.module_dir("z").relative_to(host_a.cache_dir).as_posix() + "/model.neff"
    rep = fetch(_FailingGetStore(store, bad), NeuronLayout(VERSION), host_b.cache_dir, packs=False)
    assert len(rep.transferred) == 1 and list(rep.failed) == [bad.rsplit("/", 1)[0]]
    assert "connection reset" in rep.failed[bad.rsplit("/", 1)[0]]
    assert not host_b.module_dir("z").exists()
    assert not [p for p in host_b.cache_dir.rglob("*") if ".kvbucket-tmp" in p.name]


def test_requests_are_batched(local_store: CountingStore, host_a: StandInCompiler,
                              host_b: StandInCompiler) -> None:
    store = local_store
    host_a.neff_size = 64
    for i in range(400):  # 400 entries x 4 files
        host_a.compile(f"g{i}")
    store.reset()
    rep = sync(store, NeuronLayout(VERSION), host_a.cache_dir, packs=False)  # the per-file path
    assert rep.files == 1600 and len(rep.transferred) == 400
    assert store.calls["put"] == 3  # ceil((1200 + 400 checksum records) / 1000) data batches + 1 marker batch
    assert store.calls["list"] == 1
    store.reset()
    rep = fetch(store, NeuronLayout(VERSION), host_b.cache_dir, packs=False)
    # 1,600 names listed in 2 pages; the 400 checksum records in 1 read, the 1,200 non-empty files
    # in 2 (empty ones need none)
    assert rep.files == 1600 and store.calls["get"] == 1 + 2 and store.calls["list"] == 2
    assert not rep.unverified


def test_unreachable_store_degrades_with_one_warning(host_a: StandInCompiler,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    class Down(CountingStore):
        def list(self, prefix: str = "", *, page_size: int = 1000):  # type: ignore[no-untyped-def]
            raise TransientStoreError("connection refused")

    from kvbucket.stores.local.memory import MemoryStore

    caplog.set_level(logging.WARNING, "kvbucket")
    with _cc(host_a, Down(MemoryStore()), model_id=MODEL) as s:
        host_a.compile("g")
    assert s.degraded and "connection refused" in s.degraded
    assert host_a.compilations == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_hf_hub_offline_degrades_with_one_warning(host_a: StandInCompiler, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caplog.set_level(logging.WARNING, "kvbucket")
    with compile_cache(model_id=MODEL, target="hf://buckets/acme/neuron-cache", cache_dir=host_a.cache_dir,
                       version=VERSION) as s:
        host_a.compile("g")
    assert s.degraded == "HF_HUB_OFFLINE is set" and s.fetched is None and s.synced is None
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert host_a.compilations == 1


def test_model_scope_validates_ids() -> None:
    from kvbucket.errors import ConfigError

    for bad in ("/abs/path/model", "../escape", "a/b/c", "org/na me", ""):
        with pytest.raises(ConfigError, match="model id"):
            ModelScope(bad)
    assert ModelScope("gpt2").write_path() == "_/gpt2/default/any"
