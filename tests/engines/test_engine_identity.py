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
from kvbucket.testing.identity_models import COMMITS, CONFIG, hub_snapshot, make_model_dirs

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


# ---- the vLLM tier: what vLLM hands over, plus launch extras (kvbucket.integrations.vllm_identity)
def offloading_model(name: str) -> SimpleNamespace:
    """Shaped as vLLM 0.33's OffloadingModelConfig: all a secondary tier is handed of the model."""
    return SimpleNamespace(name=name, dtype="bfloat16", max_model_len=4096)


def test_vllm_tier_identity_from_the_files_and_launch_extras(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from kvbucket.integrations.vllm import VLLMTierSettings
    from kvbucket.integrations.vllm_identity import tier_identity

    dirs = make_model_dirs(tmp_path)
    model = offloading_model(str(dirs["base"]))
    settings = VLLMTierSettings.from_tier_config({"store_url": "/x"})

    def scheduler(vllm_config: object, s: VLLMTierSettings = settings) -> object:  # vLLM's frame
        return tier_identity(model, s, s.quantization)

    quantized = SimpleNamespace(model_config=SimpleNamespace(quantization="fp8", revision=None))
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        plain = tier_identity(model, settings)  # no VllmConfig on the stack: files + KV only, logged
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "were not found" in said and '"quantization"/"revision"' in said
    assert plain is not None and plain.weights.startswith("files:")
    assert plain.fields["kv_cache_dtype"] == "bfloat16" and "engine_quantization" not in plain.fields
    found = scheduler(quantized)  # vLLM launched with --quantization fp8: another identity
    assert found is not None and found.fields["engine_quantization"] == "fp8" and found.token != plain.token
    stated = VLLMTierSettings.from_tier_config({"store_url": "/x", "quantization": "fp8"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        by_setting = tier_identity(model, stated, stated.quantization)  # stated by the user: the same
    assert by_setting is not None and by_setting.token == found.token
    other = tier_identity(offloading_model(str(dirs["weights"])), settings)
    assert other is not None and other.token != plain.token  # the files decide the weights


def test_vllm_tier_revision_of_a_repo_id_from_the_launch(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbucket.integrations.vllm import VLLMTierSettings
    from kvbucket.integrations.vllm_identity import tier_identity

    dirs = make_model_dirs(tmp_path / "m")
    repo = tmp_path / "hub" / "models--org--llama"
    for commit in COMMITS:
        hub_snapshot(repo, commit, dirs["base"])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = VLLMTierSettings.from_tier_config({"store_url": "/x"})

    def scheduler(vllm_config: object) -> object:  # vLLM resolved --revision to a commit
        return tier_identity(offloading_model("org/llama"), settings)

    main = tier_identity(offloading_model("org/llama"), settings)
    launch = SimpleNamespace(model_config=SimpleNamespace(quantization=None, revision=COMMITS[1]))
    launched = scheduler(launch)
    assert main is not None and main.weights == f"hub:{COMMITS[0]}"
    assert launched is not None and launched.weights == f"hub:{COMMITS[1]}"


def test_name_only_warnings_name_the_key_of_their_path(caplog: pytest.LogCaptureFixture) -> None:
    """Each path's warning names the setting where the user sets it, and what setting it does to
    the chunks stored so far without one."""
    from kvbucket.integrations.sglang import IDENTITY_SETTING
    from kvbucket.integrations.vllm_identity import SETTING

    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        resolve("vLLM-test", "org/unknown-a", IdentitySettings(), KV, key=SETTING)
        resolve("SGLang-test", "org/unknown-b", IdentitySettings(), KV, key=IDENTITY_SETTING)
    said = {m.split(":")[0]: m for m in (r.getMessage() for r in caplog.records) if "name only" in m}
    assert "secondary_tiers" in said["vLLM-test"]
    assert "--hicache-storage-backend-extra-config" in said["SGLang-test"]
    for text in said.values():
        assert "misses for good" in text and "--identity none" in text
