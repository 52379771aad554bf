"""The synthetic ``kvbucket demo`` through the real CLI (typer's runner), on real files."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.cli import build_app
from kvbucket.envelope import HEADER_SIZE


@pytest.fixture
def isolated_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the demo's temp dirs at tmp_path so the test can prove none is left behind."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def run(*args: str) -> Any:
    return CliRunner().invoke(build_app(), ["demo", "--synthetic", *args])


def test_demo_on_the_embedded_default(isolated_tmp: Path) -> None:
    result = run("--chunks", "3", "--model", "qwen2.5-0.5b")
    assert result.exit_code == 0, result.output
    assert "all bytes verified" in result.output
    assert "fresh engine hits per tier (local_cpu, local_disk, remote): [3, 0, 3]" in result.output
    # disk and remote reads (3 + 3) and the fresh engine's 3 remote hits were verified envelopes
    row = next(line for line in result.output.splitlines() if "integrity (envelopes)" in line)
    assert [c.strip() for c in row.strip("│ ").split("│")][1] == "9" and "0 refused" in row
    assert list(isolated_tmp.iterdir()) == []  # the temp stack is gone


def test_demo_on_a_target_directory_cleans_up_unless_keep(isolated_tmp: Path, tmp_path: Path) -> None:
    target = tmp_path / "bucket"
    result = run("--chunks", "2", "--model", "qwen2.5-0.5b", "--target", str(target))
    assert result.exit_code == 0, result.output
    assert [p for p in target.rglob("*") if p.is_file() and ".kvbucket-tmp" not in p.parts] == []
    result = run("--chunks", "2", "--model", "qwen2.5-0.5b", "--target", f"file://{target}", "--keep")
    assert result.exit_code == 0, result.output
    kept = [p for p in target.rglob("*") if p.is_file() and ".kvbucket-tmp" not in p.parts]
    assert len(kept) == 2 and all(p.stat().st_size == 3 * 1024 * 1024 + HEADER_SIZE for p in kept)


def test_demo_exits_1_when_a_byte_differs(isolated_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = LocalDiskBackend.batched_get_into

    def corrupting(self: LocalDiskBackend, keys: Any, buffers: Any) -> list[bool]:
        found = real(self, keys, buffers)
        np.asarray(buffers[0]).view(np.uint8).reshape(-1)[100] ^= 1
        return found

    monkeypatch.setattr(LocalDiskBackend, "batched_get_into", corrupting)
    result = run("--chunks", "2", "--model", "qwen2.5-0.5b")
    assert result.exit_code == 1
    assert "FAILED" in result.output


def test_demo_bad_options_exit_2_with_a_clear_line(isolated_tmp: Path) -> None:
    result = run("--model", "gpt-5")
    assert result.exit_code == 2
    assert "unknown model 'gpt-5'; choose one of qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b" in result.output
    result = run("--target", "redis://x", "--chunks", "1")
    assert result.exit_code == 2
    assert "unknown store URL scheme 'redis' in 'redis://x'" in result.output


def test_demo_help() -> None:
    result = run("--help")
    assert result.exit_code == 0, result.output
    assert "--target" in result.output and "--chunks" in result.output


def test_demo_uses_a_config_files_remote_and_cleans_it(isolated_tmp: Path, tmp_path: Path) -> None:
    target = tmp_path / "from-config"
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"remote_url: file://{target}\nextra_config:\n  fsync: true\n")
    result = run("--chunks", "2", "--model", "qwen2.5-0.5b", "--config", str(cfg))
    assert result.exit_code == 0, result.output
    assert target.is_dir()  # the store the config names was used
    assert f"file://{target}" in result.output.replace("\n", "")
    assert [p for p in target.rglob("*") if p.is_file() and ".kvbucket-tmp" not in p.parts] == []
