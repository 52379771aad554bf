"""Issue 38's engine-path redeploy, for the paths of this venv: the library's remote tier (as the
engine YAML builds it), LMCache's L2 adapter and non-MP connector (through LMCache's own
classes) and the transformers prefix cache. Each stores with one model directory; one layer's
bytes change in place; a fresh process misses every chunk and deletes nothing; the original bytes
back, a fresh process hits every chunk, byte-identical (kvbucket.testing.redeploy). The vLLM and
SGLang paths run the same steps in their venvs (tests/engines/{vllm,sglang}_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbucket.testing.redeploy import check, make_model, objects

pytest.importorskip("transformers")

@pytest.mark.parametrize("path", ["remote", "l2", "connector", "transformers"])
def test_one_layer_changed_in_place_misses_then_its_bytes_back_hit(path: str, tmp_path: Path) -> None:
    if path in ("l2", "connector"):
        pytest.importorskip("lmcache")
    model, store = make_model(tmp_path / "model"), tmp_path / "kv"
    store.mkdir()
    check(path, model, store, lambda: objects(store))
