"""The compile cache on the Hub emulator, counted at the HTTP level with its stats route."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest

from kvbucket.compile_cache import compile_cache
from kvbucket.stores.hub.open import open_hfbucket_store
from kvbucket.testing import HubEmulator
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler

MODEL = "org/model"
CONFIG = {"tp_degree": 2, "dtype": "bf16"}
DATA_ROUTES = ("batch", "xorb_upload", "shard_upload", "reconstruction", "fetch", "xorb_grant")


def _requests(hub: Any) -> dict[str, int]:
    return {k: v["requests"] for k, v in hub.stats()["routes"].items()}


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}


@pytest.fixture
def hub_store(hub_bucket: Any) -> Any:
    # No reconstruction queries sent in the background after a lookup (a KV load's head start):
    # one sent in a phase could land after that phase's count, in the next one's (ci11).
    s = open_hfbucket_store(f"hf://buckets/{hub_bucket.bucket_id}", endpoint=hub_bucket.hub.endpoint,
                            token=hub_bucket.hub.write_token, token_env="", prefetch_reconstructions=False)
    yield s
    s.close()


def test_phases_on_the_hub_and_a_warm_cache_moves_nothing(hub_store: Any, hub_bucket: Any,
                                                           tmp_path: Path) -> None:
    hub = hub_bucket.hub
    a, b = StandInCompiler(tmp_path / "a", VERSION), StandInCompiler(tmp_path / "b", VERSION)
    t0 = _requests(hub)
    with compile_cache(model_id=MODEL, export_config=CONFIG, target=hub_store, cache_dir=a.cache_dir,
                       version=VERSION):
        for i in range(30):
            a.compile(f"g{i}")
    t1 = _requests(hub)
    up = _diff(t0, t1)
    assert up.get("batch", 0) <= 3, up  # files, markers, references + record: 120+ files in 3 commits
    with compile_cache(model_id=MODEL, export_config=CONFIG, target=hub_store, cache_dir=b.cache_dir,
                       version=VERSION):
        for i in range(30):
            b.compile(f"g{i}")
    assert b.compilations == 0 and b.cache_hits == 30
    t2 = _requests(hub)
    with compile_cache(model_id=MODEL, export_config=CONFIG, target=hub_store, cache_dir=b.cache_dir,
                       version=VERSION):
        for i in range(30):
            b.compile(f"g{i}")
    warm = _diff(t2, _requests(hub))
    assert not [r for r in DATA_ROUTES if warm.get(r)], warm
    assert warm.get("tree", 0) <= 2, warm  # one listing on enter, one on exit


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens here any more


def test_unreachable_hub_degrades_to_local_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HF_ENDPOINT", _dead_endpoint())
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_0123")
    caplog.set_level(logging.WARNING, "kvbucket")
    a = StandInCompiler(tmp_path / "a", VERSION)
    with compile_cache(model_id=MODEL, target="hf://buckets/acme/unreachable", cache_dir=a.cache_dir,
                       version=VERSION, store_options={"max_retries": 1, "retry_backoff_secs": 0.05}) as s:
        a.compile("g")
    assert a.compilations == 1 and s.degraded is not None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "hf_not_a_real_token_0123" not in caplog.text


def test_hub_outage_during_the_block_degrades_with_one_warning(hub_emulator: Any, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    a = StandInCompiler(tmp_path / "a", VERSION)
    caplog.set_level(logging.WARNING, "kvbucket")
    with HubEmulator(tokens={"me": ("hf_outage_token_0123", "write")}, data_dir=tmp_path / "hub") as emu:
        from huggingface_hub import HfApi

        # (hub_emulator only isolates HF_HOME here; this test stops its own emulator)
        HfApi(endpoint=emu.endpoint, token="hf_outage_token_0123").create_bucket("me/outage", private=True)
        store = open_hfbucket_store("hf://buckets/me/outage", endpoint=emu.endpoint,
                                    token="hf_outage_token_0123", token_env="", max_retries=1,
                                    retry_backoff_secs=0.05)
        with compile_cache(target=store, cache_dir=a.cache_dir, version=VERSION) as s:
            a.compile("g")
            emu.stop()  # the Hub goes away while we compile
        store.close()
    assert s.fetched is not None and s.degraded is not None and s.synced is None
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert "hf_outage_token_0123" not in caplog.text


def test_cli_sync_fetch_lookup_against_an_hf_url(hub_bucket: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line as a user runs it: only HF_ENDPOINT/HF_TOKEN and an hf:// target."""
    import json

    from typer.testing import CliRunner

    from kvbucket.cli import build_app

    monkeypatch.setenv("HF_ENDPOINT", hub_bucket.hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_bucket.hub.write_token)
    monkeypatch.setenv("KVBUCKET_CONFIG_DIR", str(tmp_path / "cfg"))
    target = f"hf://buckets/{hub_bucket.bucket_id}/neuron"
    a, b = StandInCompiler(tmp_path / "a", VERSION), StandInCompiler(tmp_path / "b", VERSION)
    with compile_cache(model_id=MODEL, task="text-generation", export_config=CONFIG, target=target,
                       cache_dir=a.cache_dir, version=VERSION):
        a.compile("g1")
    a.compile("g2")  # compiled outside any block: `sync` publishes it
    runner, app = CliRunner(), build_app()

    def run(*args: str) -> Any:
        res = runner.invoke(app, ["compile-cache", *args, "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    rep = run("sync", "--target", target, "--cache-dir", str(a.cache_dir))
    assert len(rep["transferred"]) == 1 and len(rep["skipped"]) == 1
    rep = run("fetch", "--target", target, "--cache-dir", str(b.cache_dir), "--compiler-version", VERSION)
    assert len(rep["transferred"]) == 2
    b.compile("g1")
    b.compile("g2")
    assert b.compilations == 0
    recs = run("lookup", MODEL, "--target", target, "--tensor_parallel_size", "2",
               "--torch_dtype", "bfloat16")
    assert [r["task"] for r in recs] == ["text-generation"]


_HOST = """
import sys
from kvbucket.compile_cache import compile_cache
from kvbucket.testing.neuron_standin import StandInCompiler
target, cache_dir, own = sys.argv[1:4]
h = StandInCompiler(cache_dir)
with compile_cache(model_id="org/model", task="t", export_config={"tp_degree": 2}, target=target,
                   cache_dir=cache_dir, version=h.version) as s:
    for g in [f"shared{i}" for i in range(15)] + [f"{own}{i}" for i in range(15)]:
        h.compile(g)
assert s.degraded is None and s.synced is not None and not s.synced.failed, (s.degraded, s.synced)
print(len(s.synced.transferred))
"""


def test_two_host_processes_sync_concurrently_to_one_bucket(hub_bucket: Any, hub_store: Any,
                                                            tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import kvbucket
    from kvbucket.compile_cache import NeuronLayout

    src = str(Path(kvbucket.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "HF_ENDPOINT": hub_bucket.hub.endpoint,
           "HF_TOKEN": hub_bucket.hub.write_token}
    target = f"hf://buckets/{hub_bucket.bucket_id}"
    procs = [subprocess.Popen([sys.executable, "-c", _HOST, target, str(tmp_path / f"host{i}"), f"own{i}-"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert sum(int(o[0].strip()) for o in outs) >= 45  # 45 distinct entries; shared ones may land twice
    lay = NeuronLayout(VERSION)
    names = {o.name for o in hub_store.list()}
    entries = {e for n in names if (e := lay.entry_of(n))}
    assert len(entries) == 45 and all(lay.remote_complete(e, names) for e in entries)
    assert not [n for n in names if n.endswith((".lock", "model.log"))]
    third = StandInCompiler(tmp_path / "host3", VERSION)
    with compile_cache(model_id="org/model", task="t", target=hub_store, cache_dir=third.cache_dir,
                       version=VERSION) as s:
        for g in [f"shared{i}" for i in range(15)] + [f"own{j}-{i}" for j in range(2) for i in range(15)]:
            third.compile(g)
    assert third.compilations == 0 and s.fetched is not None and len(s.fetched.transferred) == 45
