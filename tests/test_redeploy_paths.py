"""Issue 38's engine-path redeploy, for the paths of this venv: the library's remote tier (as the
engine YAML builds it), LMCache's L2 adapter and non-MP connector (through LMCache's own
classes) and the transformers prefix cache. Each stores with one model directory; one layer's
bytes change in place; a fresh process misses every chunk and deletes nothing; the original bytes
back, a fresh process hits every chunk, byte-identical (kvbucket.testing.redeploy). The vLLM and
SGLang paths run the same steps in their venvs (tests/engines/{vllm,sglang}_checks.py).

The four paths share each step's fresh process (three processes, not twelve: each costs seconds
of imports); each path keeps its own store and every assertion names the path that failed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvbucket.testing.redeploy import check_all, make_model, objects

pytest.importorskip("transformers")


@pytest.mark.slow(30)
def test_one_layer_changed_in_place_misses_then_its_bytes_back_hit(tmp_path: Path) -> None:
    have_lmcache = importlib.util.find_spec("lmcache") is not None
    paths = ["remote", "l2", "connector", "transformers"] if have_lmcache else ["remote", "transformers"]
    model = make_model(tmp_path / "model")
    jobs = {}
    for path in paths:
        store = tmp_path / f"kv-{path}"
        store.mkdir()
        jobs[path] = (path, store, lambda store=store: objects(store))
    check_all(model, jobs)
    if not have_lmcache:  # said, as the per-path importorskip said it
        pytest.skip("LMCache's L2 adapter and connector paths need lmcache (the test extra has it)")
