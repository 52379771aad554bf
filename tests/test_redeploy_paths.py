"""Issue 38's engine-path redeploy, for the paths of this venv: the library's remote tier (as the
engine YAML builds it), LMCache's L2 adapter and non-MP connector (through LMCache's own
classes) and the transformers prefix cache. Each stores with one model directory; one layer's
bytes change in place; a fresh process misses every chunk and deletes nothing; the original bytes
back, a fresh process hits every chunk, byte-identical (kvbucket.testing.redeploy). The vLLM and
SGLang paths run the same steps in their venvs (tests/engines/{vllm,sglang}_checks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbucket.testing.redeploy import N, change_one_layer, make_model, objects, restore

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def step(path: str, mode: str, model: Path, store: Path) -> dict[str, Any]:
    """One step in a fresh process (no cache of this test process is shared)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-m", "kvbucket.testing.redeploy", path, mode, str(model), str(store)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["remote", "l2", "connector", "transformers"])
def test_one_layer_changed_in_place_misses_then_its_bytes_back_hit(path: str, tmp_path: Path) -> None:
    if path in ("l2", "connector"):
        pytest.importorskip("lmcache")
    model, store = make_model(tmp_path / "model"), tmp_path / "kv"
    store.mkdir()
    first = step(path, "store", model, store)
    chunks = {n for n in objects(store) if "_identity" not in n}
    assert len(chunks) == N and all(first["token"] in n for n in chunks), sorted(chunks)
    manifests = [n for n in objects(store) if "_identity" in n]
    assert len(manifests) == 1 and manifests[0].endswith(first["token"]), "the writer records its manifest"
    before = objects(store)

    original = change_one_layer(model)
    changed = step(path, "read", model, store)
    assert changed["token"] != first["token"], "one layer's new bytes are another identity"
    assert changed["hits"] == 0 and changed["digests"] == [None] * N, changed
    assert objects(store) == before, "nothing deleted, nothing rewritten"

    restore(model, original)
    back = step(path, "read", model, store)
    assert back["token"] == first["token"]
    assert back["hits"] == N and back["digests"] == first["digests"], "every chunk, byte-identical"
    assert objects(store) == before
