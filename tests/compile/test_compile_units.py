"""Logic of the compile cache that needs no server: resolution, normalization, layouts, the lock."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from kvbucket.compile_cache import DirectoryLayout, EntryState, compile_cache, fetch, sync
from kvbucket.compile_cache.lookup import config_id, normalize_config, parse_filter_args
from kvbucket.compile_cache.neuron_env import resolve_neuron_cache
from kvbucket.compile_cache.settings import resolve_target, save_target
from kvbucket.compile_cache.sync import SyncBusyError
from kvbucket.compile_cache.transfer import LOCK_NAME
from kvbucket.errors import ConfigError
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler


@pytest.mark.parametrize(
    ("cache_dir", "env", "local", "remote", "disabled"),
    [
        ("/x", {"NEURON_COMPILE_CACHE_URL": "/y"}, "/x", None, False),
        (None, {"NEURON_COMPILE_CACHE_URL": "/y", "NEURON_CC_FLAGS": "--cache_dir=/z"}, "/y", None, False),
        (None, {"NEURON_COMPILE_CACHE_URL": "s3://b/p", "NEURON_CC_FLAGS": "--cache_dir=/z"}, "/z", "s3://b/p",
         False),
        (None, {"NEURON_COMPILE_CACHE_URL": "s3://b/p"}, "/var/tmp/neuron-compile-cache", "s3://b/p", False),
        (None, {"NEURON_CC_FLAGS": "-O1 --cache_dir /w --no-cache"}, "/w", None, True),
        (None, {}, "/var/tmp/neuron-compile-cache", None, False),
    ],
)
def test_neuron_cache_dir_resolution(cache_dir: str | None, env: dict[str, str], local: str,
                                     remote: str | None, disabled: bool) -> None:
    loc = resolve_neuron_cache(cache_dir, env)
    assert (str(loc.local_dir), loc.remote_url, loc.disabled) == (local, remote, disabled)


def test_normalized_configs_match_across_front_ends() -> None:
    a = normalize_config({"tp_degree": 2, "auto_cast_type": "bf16", "batch_size": 1, "sequence_length": 4096})
    b = normalize_config({"tensor_parallel_size": "2", "dtype": "torch.bfloat16", "max_num_seqs": 1,
                          "max_model_len": 4096.0})
    assert a == b == {"batch_size": 1, "dtype": "bfloat16", "sequence_length": 4096,
                      "tensor_parallel_size": 2}
    assert config_id(a) == config_id(b) and len(config_id(a)) == 16
    with pytest.raises(ConfigError, match="twice"):
        normalize_config({"tp_degree": 2, "tensor_parallel_size": 4})
    with pytest.raises(ConfigError, match="flat dicts of scalars"):
        normalize_config({"neuron": {"tp_degree": 2}})
    assert parse_filter_args(["--tp_degree", "2", "--dtype=bf16"]) == {"tp_degree": "2", "dtype": "bf16"}
    with pytest.raises(ConfigError, match="needs a value"):
        parse_filter_args(["--dtype"])


def test_target_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBUCKET_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("KVBUCKET_COMPILE_CACHE", raising=False)
    assert resolve_target() is None
    save_target("hf://buckets/acme/saved")
    assert resolve_target() == "hf://buckets/acme/saved"
    assert resolve_target(neuron_remote="s3://neuron/cache") == "s3://neuron/cache"
    monkeypatch.setenv("KVBUCKET_COMPILE_CACHE", "s3://env/x")
    assert resolve_target(neuron_remote="s3://neuron/cache") == "s3://env/x"
    # The CLI's rule for a bare target (docs/cli.md): ./x is a local path, ns/bucket a bucket id.
    assert resolve_target("./relative/dir") == str(Path("relative/dir").absolute())
    assert resolve_target("relative/dir") == "hf://buckets/relative/dir"


def test_no_cache_flag_disables_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no-cache")
    store = CountingStore(MemoryStore())
    host = StandInCompiler(tmp_path / "c", VERSION)
    with compile_cache(target=store, cache_dir=host.cache_dir, version=VERSION) as s:
        host.compile("g")
    assert s.disabled and store.total_calls == 0


def test_s3_neuron_cache_url_is_a_target_not_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    seaweedfs: Any, s3_bucket: str) -> None:
    """Neuron pointed at S3: kvbucket syncs there (a real SeaweedFS) and keeps its local dir."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", f"s3://{s3_bucket}/neuron-cache")
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir={tmp_path / 'local'}")
    monkeypatch.setenv("KVBUCKET_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.delenv("KVBUCKET_COMPILE_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    host = StandInCompiler(tmp_path / "local", VERSION)
    with compile_cache(version=VERSION) as s:
        host.compile("g")
    assert s.target == f"s3://{s3_bucket}/neuron-cache" and s.cache_dir == tmp_path / "local"
    assert s.synced is not None and len(s.synced.transferred) == 1 and not (tmp_path / "s3:").exists()
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
            if not o["Key"].startswith(("neuron-cache/.kvbucket/packs/", "neuron-cache/.kvbucket/sums/"))]
    assert len(keys) == 4 and all(k.startswith(f"neuron-cache/neuronxcc-{VERSION}/MODULE_") for k in keys)


def test_one_writer_per_host(tmp_path: Path) -> None:
    host = StandInCompiler(tmp_path / "c", VERSION)
    host.compile("g")
    from kvbucket.compile_cache import NeuronLayout

    with FileLock(str(host.cache_dir / LOCK_NAME)), pytest.raises(SyncBusyError, match="another process"):
        sync(MemoryStore(), NeuronLayout(VERSION), host.cache_dir, lock_timeout=0.2)


def test_a_busy_lock_in_a_block_degrades_with_one_warning(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    host = StandInCompiler(tmp_path / "c", VERSION)
    host.compile("g")
    caplog.set_level(logging.WARNING, "kvbucket")
    with FileLock(str(host.cache_dir / LOCK_NAME)), compile_cache(
            target=MemoryStore(), cache_dir=host.cache_dir, version=VERSION, lock_timeout=0.2) as s:
        host.compile("h")
    assert s.degraded and "another process" in s.degraded
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def _triton_like(root: Path) -> None:
    """Triton/Inductor-style dirs: finished hash dirs, a temp dir, a temp file, a lone file."""
    (root / "AAA").mkdir(parents=True)
    (root / "AAA" / "kernel.cubin").write_bytes(b"\x7fELF" * 100)
    (root / "AAA" / "__grp__kernel.json").write_text("{}")
    (root / "BBB").mkdir()
    (root / "BBB" / "kernel.so").write_bytes(b"so" * 10)
    (root / "BBB" / "kernel.so.tmp.pid_12_34").write_bytes(b"half")
    (root / "tmp.pid_99_1234").mkdir()
    (root / "tmp.pid_99_1234" / "x").write_bytes(b"x")
    (root / "fxgraph.bin").write_bytes(b"graph")


def test_directory_layout_states_markers_and_growth(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _triton_like(src)
    lay = DirectoryLayout()
    states = {e.name: e.state for e in lay.scan(src)}
    assert states == {"AAA": EntryState.GOOD, "BBB": EntryState.IN_PROGRESS, "fxgraph.bin": EntryState.GOOD,
                      "tmp.pid_99_1234": EntryState.IN_PROGRESS}
    store = CountingStore(MemoryStore())
    rep = sync(store, lay, src)
    assert sorted(rep.transferred) == ["AAA", "fxgraph.bin"] and rep.held_back == {"in_progress": 2}
    names = {o.name for o in store.list() if not o.name.startswith(".kvbucket/packs/")}
    assert names == {"AAA/kernel.cubin", "AAA/__grp__kernel.json", "fxgraph.bin",
                     ".kvbucket/complete/AAA.json", ".kvbucket/complete/fxgraph.bin.json",
                     ".kvbucket/sums/directory/AAA.json", ".kvbucket/sums/directory/fxgraph.bin.json"}
    manifest = json.loads(store.get(".kvbucket/complete/AAA.json") or b"")
    assert manifest["files"] == {"AAA/kernel.cubin": 400, "AAA/__grp__kernel.json": 2}

    rep = fetch(store, lay, dst)
    assert sorted(rep.transferred) == ["AAA", "fxgraph.bin"]
    assert (dst / "fxgraph.bin").read_bytes() == b"graph"
    assert (dst / "AAA" / "kernel.cubin").read_bytes() == b"\x7fELF" * 100

    # the writer finishes BBB and adds a file to AAA: the next sync sends exactly that
    (src / "BBB" / "kernel.so.tmp.pid_12_34").rename(src / "BBB" / "kernel.json")
    (src / "AAA" / "kernel.ptx").write_text("ptx")
    store.reset()
    rep = sync(store, lay, src)
    assert sorted(rep.transferred) == ["AAA", "BBB"] and rep.skipped == ["fxgraph.bin"]
    # kernel.ptx, BBB's two files and both checksum records, then the two markers (+ a pack of AAA
    # and BBB, and its index)
    assert store.items["put"] == 3 + 2 + 2 + 2 and rep.packs == 1
    # the older pack holds AAA without kernel.ptx: fetch must take AAA as the flat area has it now
    rep = fetch(store, lay, tmp_path / "dst2")
    assert sorted(rep.transferred) == ["AAA", "BBB", "fxgraph.bin"] and rep.pack_entries == 3
    assert (tmp_path / "dst2" / "AAA" / "kernel.ptx").read_text() == "ptx"


def test_directory_layout_needs_a_cache_dir() -> None:
    with pytest.raises(ConfigError, match="cache_dir"):
        compile_cache(layout="directory", target=MemoryStore()).__enter__()


def test_nested_directory_entries_round_trip_with_model_references(tmp_path: Path) -> None:
    """Inductor-like tree with depth=2: entries are fxgraph/<xx> and aotautograd/<hash>."""
    src = tmp_path / "src"
    lay = DirectoryLayout("inductor-test", depth=2)
    store = CountingStore(MemoryStore())
    with compile_cache(model_id="org/m", task="t", layout=lay, cache_dir=src, target=store) as s:
        for rel, data in {"fxgraph/ab/key1/graph.py": b"g1", "fxgraph/cd/key2/graph.py": b"g2",
                          "aotautograd/hash1/entry": b"a1", "locks/ab.lock": b""}.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
    assert s.synced is not None
    assert sorted(s.synced.transferred) == ["aotautograd/hash1", "fxgraph/ab", "fxgraph/cd"]
    assert s.synced.held_back == {"in_progress": 1}
    refs = [o.name for o in store.list(".kvbucket/models/inductor-test/org/m/t/any/")]
    assert sorted(refs)[0].endswith("/aotautograd%2Fhash1")
    dst = tmp_path / "dst"
    with compile_cache(model_id="org/m", task="t", layout=lay, cache_dir=dst, target=store) as s2:
        pass
    assert s2.fetched is not None and sorted(s2.fetched.transferred) == sorted(s.synced.transferred)
    assert (tmp_path / "dst" / "fxgraph" / "cd" / "key2" / "graph.py").read_bytes() == b"g2"
    assert not (tmp_path / "dst" / "locks").exists()


def test_remote_names_cannot_climb_out_of_the_cache_dir(tmp_path: Path) -> None:
    from kvbucket.compile_cache import NeuronLayout
    from kvbucket.stores.base import ItemResult, ObjectInfo

    group = f"neuronxcc-{VERSION}"

    class Hostile(MemoryStore):
        def list(self, prefix: str = "", *, page_size: int = 1000):  # type: ignore[no-untyped-def]
            for n in ("model.neff", "model.done", "../../escaped"):
                yield ObjectInfo(f"{group}/MODULE_1+2/{n}", 4)

        def get_many(self, names, out=None):  # type: ignore[no-untyped-def]
            assert not [n for n in names if ".." in n]
            if out is None:  # the entries' checksum records: none (as another tool's sync leaves it)
                return [ItemResult(n) for n in names]
            for b in out or []:
                memoryview(b)[:] = b"data"
            return [ItemResult(n, size=4, data=b) for n, b in zip(names, out or [], strict=True)]

    rep = fetch(Hostile(), NeuronLayout(VERSION), tmp_path / "c")
    assert rep.transferred == [f"{group}/MODULE_1+2"] and rep.files == 2
    assert rep.unverified == [f"{group}/MODULE_1+2"]
    assert not list(tmp_path.rglob("escaped"))


def test_torch_layout_default_dir_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stat

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVBUCKET_TORCH_CACHE_DIR", raising=False)
    with compile_cache(layout="torch", key="k", target=MemoryStore()) as s:
        pass
    assert s.cache_dir == tmp_path / ".cache" / "kvbucket" / "torch-compile"
    assert stat.S_IMODE(s.cache_dir.stat().st_mode) == 0o700
    assert s.degraded is None and s.fetched is not None and s.fetched.transferred == []


def test_progress_bars_report_the_bytes_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each transfer's bar counts the bytes it moved (what a terminal shows; in a log the same
    object writes a line every few seconds, and nothing for work shorter than that)."""
    from kvbucket.compile_cache import NeuronLayout
    # the modules (the package's names ``sync`` and ``fetch`` are the functions)
    sync_mod = importlib.import_module("kvbucket.compile_cache.sync")
    fetch_mod = importlib.import_module("kvbucket.compile_cache.fetch")
    from kvbucket.compile_cache.transfer import progress_bar

    bars: list[Any] = []

    def recording(progress: bool, total: int, desc: str) -> Any:
        bars.append(progress_bar(progress, total, desc))
        return bars[-1]

    monkeypatch.setattr(sync_mod, "progress_bar", recording)
    monkeypatch.setattr(fetch_mod, "progress_bar", recording)
    host = StandInCompiler(tmp_path / "a", VERSION)
    host.compile("g")
    store = MemoryStore()
    moved = 4096 + len("g") + len('["--O2"]')
    rep = sync(store, NeuronLayout(VERSION), host.cache_dir, progress=True)
    assert rep.bytes == moved
    rep = fetch(store, NeuronLayout(VERSION), tmp_path / "b", progress=True)
    assert rep.bytes == moved
    # sync moves the files (and packs them); fetch takes the pack: its bar counts the pack's bytes
    assert [(b.desc, b.total, b.done) for b in bars[:1]] == [("sync", moved, moved)]
    assert bars[1].desc == "fetch (packs)" and bars[1].total == bars[1].done >= moved
    assert all(b.total == b.done == 0 for b in bars[2:])  # nothing left to fetch file by file
