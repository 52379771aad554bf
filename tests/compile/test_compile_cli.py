"""``kvbucket compile-cache`` end to end on a directory target, with the stand-in compiler."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvbucket.cli import build_app
from kvbucket.compile_cache import compile_cache
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import CompileFailed, StandInCompiler

GROUP = f"neuronxcc-{VERSION}"


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KVBUCKET_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("KVBUCKET_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    runner = CliRunner()
    app = build_app()

    def run(*args: str, code: int = 0) -> Any:
        res = runner.invoke(app, ["compile-cache", *args])
        assert res.exit_code == code, (args, res.exit_code, res.output, res.exception)
        return res

    return run


def _json(res: Any) -> Any:
    return json.loads(res.stdout)


def test_create_set_sync_fetch_status(cli: Any, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    res = cli("create", str(bucket))
    assert stat.S_IMODE(bucket.stat().st_mode) == 0o700
    assert "default target saved" in res.stdout
    cfg = tmp_path / "config" / "compile_cache.json"
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600 and json.loads(cfg.read_text())["target"] == str(bucket)

    a = StandInCompiler(tmp_path / "a", VERSION)
    for g in ("x", "y", "z"):
        a.compile(g)
    with pytest.raises(CompileFailed):
        a.compile("broken", fail=True)
    a.compile("dead", crash=True)
    st = _json(cli("status", "--cache-dir", str(a.cache_dir), "--compiler-version", VERSION, "--json"))
    (g,) = st["groups"]
    assert g["group"] == GROUP and g["current"] is True
    assert g["entries"] == {"good": 3, "failed": 1, "in_progress": 1}

    rep = _json(cli("sync", "--cache-dir", str(a.cache_dir), "--json"))
    assert len(rep["transferred"]) == 3 and rep["held_back"] == {"failed": 1, "in_progress": 1}
    assert not [p for p in bucket.rglob("*") if p.name.endswith((".lock", "model.log"))]
    rep = _json(cli("sync", "--cache-dir", str(a.cache_dir), "--json"))
    assert rep["transferred"] == [] and len(rep["skipped"]) == 3

    b = StandInCompiler(tmp_path / "b", VERSION)
    rep = _json(cli("fetch", "--cache-dir", str(b.cache_dir), "--compiler-version", VERSION, "--json"))
    assert len(rep["transferred"]) == 3 and rep["files"] == 12
    for g2 in ("x", "y", "z"):
        b.compile(g2)
    assert b.compilations == 0


def test_lookup_with_normalized_filters(cli: Any, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    cli("set", str(bucket), code=2)  # a directory target must exist (issue 16)
    bucket.mkdir()
    cli("set", str(bucket))
    a = StandInCompiler(tmp_path / "a", VERSION)
    for cfg in ({"tp_degree": 2, "auto_cast_type": "bf16", "batch_size": 1, "sequence_length": 4096},
                {"tp_degree": 8, "auto_cast_type": "fp16", "batch_size": 4, "sequence_length": 4096}):
        with compile_cache(model_id="org/m", task="text-generation", export_config=cfg, cache_dir=a.cache_dir,
                           version=VERSION):
            a.compile(json.dumps(cfg))
    recs = _json(cli("lookup", "org/m", "--json", "--tensor_parallel_size", "2", "--dtype=bfloat16",
                     "--max_model_len", "4096"))
    assert [r["config"]["tensor_parallel_size"] for r in recs] == [2]
    assert len(_json(cli("lookup", "org/m", "--json", "--compiler-version", VERSION))) == 2
    res = cli("lookup", "org/m", "--max_num_seqs", "4")
    assert "1 cached export" in res.stdout and "batch_size=4" in res.stdout
    cli("lookup", "org/m", "--dtype", "float32", code=1)
    res = cli("lookup", "org/m", "stray", code=2)
    assert "filters look like" in res.output


def test_cleanup_dry_run_then_for_real(cli: Any, tmp_path: Path) -> None:
    a = StandInCompiler(tmp_path / "a", VERSION)
    a.compile("ok")
    with pytest.raises(CompileFailed):
        a.compile("bad", fail=True)
    a.compile("dead", crash=True)
    a.compile("ok-but-locked")
    (a.module_dir("ok-but-locked") / "model.neff.lock").write_bytes(b"")
    old = StandInCompiler(tmp_path / "a", "2.14.0.0+deadbeef")
    old.compile("old")
    (a.cache_dir / GROUP / ".kvbucket-tmp-MODULE_x-1234").mkdir()

    args = ["--cache-dir", str(a.cache_dir), "--compiler-version", VERSION, "--json"]
    rep = _json(cli("cleanup", *args, "--old-versions", "--dry-run"))
    reasons = sorted(r["reason"] for r in rep["removed"])
    assert reasons == ["dead compile (stale lock, no output)", "failed compile", "old compiler version",
                       "stale lock", "unfinished kvbucket download"]
    assert old.module_dir("old").exists()  # dry run removed nothing
    cli("cleanup", *args, "--old-versions")
    st = _json(cli("status", *args))
    assert [g["group"] for g in st["groups"]] == [GROUP]
    assert st["groups"][0]["entries"] == {"good": 2}
    a.compilations = 0
    a.compile("bad")  # no longer blocked by the cached failure
    a.compile("dead")  # nor by the dead lock
    assert a.compilations == 2


def test_cleanup_refuses_while_the_compiler_runs(cli: Any, tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "neuronx-cc"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(fake), "compile"])
    try:
        time.sleep(0.2)
        res = cli("cleanup", "--cache-dir", str(tmp_path / "c"), code=1)
        assert "neuronx-cc is running" in res.output and str(proc.pid) in res.output
    finally:
        proc.kill()
        proc.wait()


def test_bad_input_gets_actionable_errors(cli: Any, tmp_path: Path) -> None:
    res = cli("sync", "--cache-dir", str(tmp_path), code=2)
    assert "no compile cache target" in res.output
    res = cli("set", "ftp://example.com/x", code=2)
    assert "unsupported compile cache target" in res.output
    res = cli("set", "hf://buckets/only-namespace", code=2)
    assert "does not name a bucket" in res.output
    res = cli("fetch", "/local/path/model", "--target", str(tmp_path / "b"), "--cache-dir", str(tmp_path),
              code=2)
    assert "not a Hub model id" in res.output
    res = cli("status", "--layout", "nope", code=2)
    assert "unknown compile cache layout" in res.output
    res = cli("create", str(tmp_path / "d"), "--public", code=2)
    assert "--public is for Hub buckets" in res.output


def test_create_makes_a_private_hub_bucket_unless_public(cli: Any, hub_emulator: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub_emulator.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_emulator.write_token)
    ns = hub_emulator.namespace
    res = cli("create", f"hf://buckets/{ns}/cc-private", "--no-set")
    assert "(private)" in res.stdout
    assert hub_emulator.api().bucket_info(f"{ns}/cc-private").private is True
    res = cli("create", f"hf://buckets/{ns}/cc-public", "--public")
    assert "(public)" in res.stdout and "default target saved" in res.stdout
    assert hub_emulator.api().bucket_info(f"{ns}/cc-public").private is False
    res = cli("create", f"hf://buckets/{ns}/cc-public")  # exists and public: kept, and said so
    assert "PUBLIC" in res.output and hub_emulator.api().bucket_info(f"{ns}/cc-public").private is False
    assert hub_emulator.write_token not in res.output


def test_directory_layout_from_the_command_line(cli: Any, tmp_path: Path) -> None:
    src, dst, bucket = tmp_path / "ind", tmp_path / "ind2", tmp_path / "bucket"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "graph.py").write_text("x = 1")
    (src / "fxgraph" / "cd.tmp").write_text("half")
    bucket.mkdir()  # a directory target must exist, as for `compile-cache set` (issue 24 item 17)
    args = ["--layout", "directory:inductor:2", "--target", str(bucket), "--json"]
    rep = _json(cli("sync", "--cache-dir", str(src), *args))
    assert rep["transferred"] == ["fxgraph/ab"] and rep["held_back"] == {"in_progress": 1}
    rep = _json(cli("fetch", "--cache-dir", str(dst), *args))
    assert rep["transferred"] == ["fxgraph/ab"]
    assert (dst / "fxgraph" / "ab" / "graph.py").read_text() == "x = 1"
    res = cli("status", "--layout", "directory:inductor:x", code=2)
    assert "depth must be a number" in res.output
