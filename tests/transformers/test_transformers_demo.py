"""Smoke test of `kvbucket demo` with a tiny model: two machine processes, the emulator, the table.

The run on the in-process Hub emulator (the default target) and its table are checked by
tests/cli/test_cli_remote_hit.py::test_demo_latency_ms_delays_machine_b_on_the_emulator, which
runs that demo once, as the installed script, with --latency-ms added.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def run_demo(*args: str, columns: str = "200") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVBUCKET_DEMO_SIZE": "tiny", "COLUMNS": columns}
    return subprocess.run(
        [sys.executable, "-m", "kvbucket", "demo", "--prompt-tokens", "512", "--new-tokens", "8", *args],
        env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow(12)
def test_demo_on_a_directory_target_cleans_up(tmp_path: Path) -> None:
    """Also as in `make demo > log` (issue 31): a line per step on stderr as it starts, and the
    table whole in an 80-column log (the target path is longer than that)."""
    target = tmp_path / ("a-shared-directory-with-a-long-name-" * 2) / "shared"
    result = run_demo("--target", str(target), columns="80")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "512 of 544" in result.stdout
    assert f"shared tier: {target}" in result.stdout and "…" not in result.stdout, result.stdout
    # each step's line, once: a step longer than the progress interval repeats its line (a loaded machine)
    lines = [ln.rsplit(": ", 1)[0] for ln in result.stderr.splitlines() if ln.startswith("machine ")]
    steps = [ln for i, ln in enumerate(lines) if i == 0 or ln != lines[i - 1]]
    assert steps[:2] == ["machine A: building the model (seed 0)",
                         "machine A: answering 544 tokens (no cache yet)"], result.stderr
    leftovers = [p for p in target.rglob("*") if p.is_file()]
    assert leftovers == [], f"the demo left chunks behind: {leftovers}"


def test_demo_refuses_a_bad_dtype() -> None:
    result = run_demo("--dtype", "int3")
    assert result.returncode != 0 and "int3" in result.stdout + result.stderr


def test_synthetic_only_flags_select_the_synthetic_demo(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvbucket.cli import build_app

    runner = CliRunner()
    target = tmp_path / "synthetic"
    args = ["demo", "--chunks", "2", "--model", "qwen2.5-0.5b", "--target", str(target)]
    result = runner.invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    assert "synthetic" in result.output
    result = runner.invoke(build_app(), ["demo", "--synthetic", "--dtype", "bfloat16"])
    assert result.exit_code != 0 and "--dtype" in result.output and "real-model demo" in result.output
