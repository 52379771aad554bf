"""kvbucket.integrations.engine_identity in the main venv (no engine): what an engine tier takes
its model identity from, in order. The engines' own runs are in vllm_checks.py / sglang_checks.py."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbucket.integrations.engine_identity import (
    IdentitySettings,
    engine_config_on_stack,
    hub_cache_snapshot,
    resolve,
)
from kvbucket.testing.identity_models import COMMITS, CONFIG, make_model_dirs

KV = {"kv_cache_dtype": "bfloat16"}


def model_config(path: str, commit: str | None = None, rope: dict | None = None) -> SimpleNamespace:
    """Shaped as vLLM's and SGLang's ModelConfig: model path, revision, HF config, dtype."""
    hf = SimpleNamespace(**{**CONFIG, **({"rope_scaling": rope} if rope else {})})
    if commit:
        hf._commit_hash = commit
    return SimpleNamespace(model=path, revision=None, hf_config=hf, hf_text_config=hf,
                           quantization=None, dtype="torch.bfloat16", max_model_len=4096)


def test_the_engines_model_config_first(tmp_path: Path) -> None:
    dirs = make_model_dirs(tmp_path)
    s = IdentitySettings()
    a = resolve("t", "org/llama", s, KV, model_config("org/llama", COMMITS[0]))
    b = resolve("t", "org/llama", s, KV, model_config("org/llama", COMMITS[1]))
    c = resolve("t", "org/llama", s, KV, model_config("org/llama", COMMITS[0], {"factor": 2.0}))
    assert a is not None and a.weights == f"hub:{COMMITS[0]}" and a.fields["engine_dtype"] == "bfloat16"
    assert b is not None and c is not None and len({a.token, b.token, c.token}) == 3
    # no commit in the HF config: the model's local files
    d = resolve("t", str(dirs["base"]), s, KV, model_config(str(dirs["base"])))
    assert d is not None and d.weights.startswith("files:")


def test_found_on_the_callers_stack_as_vllm_holds_it() -> None:
    def tier() -> object:
        return engine_config_on_stack("model_config", ("vllm_config",))

    def scheduler(vllm_config: object) -> object:  # OffloadingConnectorScheduler.__init__'s local
        return tier()

    cfg = SimpleNamespace(model_config=model_config("org/llama", COMMITS[0]))
    assert scheduler(cfg) is cfg and tier() is None


def test_hub_cache_and_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    dirs = make_model_dirs(tmp_path / "m")
    repo = tmp_path / "hub" / "models--org--llama"
    (repo / "snapshots" / COMMITS[0]).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_snapshot("org/llama") == repo / "snapshots" / COMMITS[0]
    assert hub_cache_snapshot("org/llama", "v2") is None and hub_cache_snapshot("org/other") is None
    got = resolve("t", "org/llama", IdentitySettings(), KV)
    assert got is not None and got.weights == f"hub:{COMMITS[0]}"
    explicit = resolve("t", "org/llama", IdentitySettings(model_identity=str(dirs["base"])), KV)
    assert explicit is not None and explicit.weights.startswith("files:") and explicit.model == "org/llama"
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        assert resolve("t", "org/llama", IdentitySettings(model_identity="off"), KV) is None
        assert resolve("t2", "org/unknown", IdentitySettings(), KV) is None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot tell which weights" in said and "by model name only" in said
