"""torch.compile artifacts through the bucket: compile in one process, hit the cache in a fresh one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvbucket

pytestmark = pytest.mark.torch

SRC = str(Path(kvbucket.__file__).resolve().parents[1])


def _probe(target: str, cache_dir: Path, inductor_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": SRC,
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvbucket.testing.torch_compile_probe", target, str(cache_dir)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=cache_dir.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow(32)
def test_fresh_process_hits_the_artifacts_another_one_compiled(tmp_path: Path) -> None:
    target = str(tmp_path / "bucket")
    cold = _probe(target, tmp_path / "kv-a", tmp_path / "inductor-a")
    assert cold["fxgraph_cache_miss"] >= 1 and cold["fxgraph_cache_hit"] == 0
    assert cold["synced"] and cold["synced"][0].startswith("torch-")

    warm = _probe(target, tmp_path / "kv-b", tmp_path / "inductor-b")  # empty local caches
    assert warm["fetched"] == cold["synced"] and warm["loaded"] == cold["synced"]
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0
    assert warm["autograd_cache_hit"] >= 1 and warm["autograd_cache_miss"] == 0
    assert warm["synced"] == []  # nothing new: a warm process publishes nothing
