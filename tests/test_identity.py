"""kvbucket.identity: what a model's identity holds, its token, names with it, and the library's
remote tier keyed by it (built from an engine config's ``extra_config.model_identity``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig, build_backend
from kvbucket.identity import weights as weights_mod
from kvbucket.identity.core import (
    IdentitySetting,
    ModelIdentity,
    config_fields,
    identity_of_dir,
    is_token,
    qualify_key_string,
    split,
    split_key_string,
)
from kvbucket.identity.manifest import read_identities
from kvbucket.identity.weights import files_fingerprint, hub_commit
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key
from kvbucket.testing.identity_models import COMMITS, OTHER_VARIANTS, make_model_dirs

LAYOUT = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)


def test_each_kind_of_redeploy_is_another_identity(tmp_path: Path) -> None:
    dirs = make_model_dirs(tmp_path)
    ids = {k: identity_of_dir(p, "org/llama") for k, p in dirs.items()}
    assert ids["revision"].weights == f"hub:{COMMITS[0]}" and ids["revision2"].weights == f"hub:{COMMITS[1]}"
    assert ids["base"].weights.startswith("files:")
    tokens = {k: i.token for k, i in ids.items()}
    assert len({tokens[k] for k in ("base", "revision2", *OTHER_VARIANTS)}) == 5
    # copied to another path with other mtimes: the same identity (fleet nodes share chunks)
    assert tokens["copy"] == tokens["base"]
    # the same weights with another rope_scaling differ by config only
    assert ids["rope"].weights == ids["base"].weights and ids["rope"].fields["rope_scaling"]["factor"] == 4.0
    assert len(tokens["base"]) == 16 and int(tokens["base"], 16) >= 0


def test_the_weight_files_are_read_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    base = make_model_dirs(tmp_path)["base"]
    reads: list[str] = []
    real = weights_mod.hash_files
    monkeypatch.setattr(weights_mod, "hash_files", lambda sizes: (reads.extend(sizes), real(sizes))[1])
    first = files_fingerprint(base)
    assert files_fingerprint(base) == first and len(reads) == 1
    (base / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes()[:-1] + b"\x00")
    assert files_fingerprint(base) != first and len(reads) == 2  # rewritten: read again


def test_hub_commit_from_config_or_snapshot_path(tmp_path: Path) -> None:
    assert hub_commit(config={"_commit_hash": COMMITS[1]}) == COMMITS[1]
    assert hub_commit(make_model_dirs(tmp_path)["revision"]) == COMMITS[0]  # huggingface_hub's layout
    assert hub_commit("/models/llama") is None and hub_commit(config={"_commit_hash": "main"}) is None


def test_config_fields_are_the_whole_config_minus_what_cannot_change_the_kv() -> None:
    cfg = {"rope_scaling": {"factor": 2.0, "rope_type": "linear"}, "num_key_value_heads": 8,
           "transformers_version": "4.57", "_name_or_path": "/x", "max_position_embeddings": 8192,
           "architectures": ["X"], "eos_token_id": 2, "temperature": 0.7, "rms_norm_eps": 1e-6,
           "some_future_field": 3, "torch_dtype": "bfloat16", "sliding_window": None,
           "text_config": {"rope_theta": 1e6, "bos_token_id": 1, "_name_or_path": "y"}}
    assert config_fields(cfg) == {
        "rope_scaling": {"factor": 2.0, "rope_type": "linear"}, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "some_future_field": 3,
        "dtype": "bfloat16", "text_config": {"rope_theta": 1e6}}  # fmt: skip


def test_config_fields_of_a_transformers_config_include_its_nested_configs() -> None:
    """An engine's resolved config (a ``PretrainedConfig``) counts whole, sub-configs included."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3Config(text_config={"sliding_window": 512}, vision_config={"patch_size": 14})
    fields = config_fields(cfg)
    assert fields["text_config"]["sliding_window"] == 512 and fields["vision_config"]["patch_size"] == 14
    assert "architectures" not in fields and "_name_or_path" not in fields["text_config"]
    # transformers 5 keeps rope_theta in rope_parameters (per attention type): it counts there
    cfg.text_config.rope_parameters["full_attention"]["rope_theta"] = 2e6
    assert config_fields(cfg)["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] == 2e6
    assert config_fields(cfg) != fields


def test_names_carry_the_token_and_give_it_back() -> None:
    tok = ModelIdentity.from_setting("org/m", "org/m@abc").token
    assert qualify_key_string("org/m@1@0@ff@bfloat16", tok) == f"org/m~{tok}@1@0@ff@bfloat16"
    assert split_key_string(f"org/m~{tok}@1@0@ff") == ("org/m@1@0@ff", tok)
    assert split_key_string("org/m@1@0@ff") == ("org/m@1@0@ff", None)
    assert split("org/m~nothex") == ("org/m~nothex", None)
    # a token as the setting is taken as is (what `kvbucket du` shows, set to reuse those chunks)
    assert ModelIdentity.from_setting("org/m", tok).token == tok
    setting = IdentitySetting({"org/a": "a-v1"})
    assert setting.token("org/a") and setting.token("org/b") is None


def test_remote_tier_other_identity_misses_and_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "remote"

    def tier(identity: str | None):  # type: ignore[no-untyped-def]
        extra = {} if identity is None else {"model_identity": identity}
        return build_backend(EngineConfig(local_cpu=False, remote_url=str(root), chunk_size=16,
                                          extra_config=extra), LAYOUT)  # fmt: skip

    keys = [key(i) for i in range(4)]
    data = [chunk_bytes(LAYOUT, i) for i in range(4)]
    with tier("org/model@rev-1") as first:
        first.batched_put(list(zip(keys, data, strict=True)))
        assert first.batched_contains(keys) == [True] * 4
    stored = {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    chunks = {n for n in stored if "_identity" not in n and not is_token(n)}
    assert len(chunks) == 4 and all("~" in n.split("@")[0] for n in chunks)
    # the first writer recorded its identity (engine YAML: extra_config.model_identity)
    token = IdentitySetting("org/model@rev-1").token("x")
    assert set(read_identities(FileStore(root), "", "meta-llama/Llama-3.1-8B")) == {token}
    for other in ("org/model@rev-2", None):  # another identity, and name-only
        with tier(other) as t:
            assert t.batched_contains(keys) == [False] * 4 and t.batched_get(keys) == [None] * 4
            # listed as the keys they were written under (with the token), never as this tier's
            assert not set(t.list()) & {k.to_string() for k in keys}
    assert {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file()} == stored
    with tier("org/model@rev-1") as again:
        assert [as_bytes(c) for c in again.batched_get(keys)] == data
        assert sorted(again.list()) == sorted(k.to_string() for k in keys)


def test_disk_tier_keys_chunks_by_identity_too(tmp_path: Path) -> None:
    """A redeploy on the same host reopens the disk tier's private directory: the old identity's
    chunks are not served (and are kept, in the tier's byte bound, the first evicted)."""
    from kvbucket.backends.local_disk import LocalDiskBackend

    keys = [key(i) for i in range(3)]
    data = [chunk_bytes(LAYOUT, i) for i in range(3)]
    with LocalDiskBackend(tmp_path / "disk", 1 << 20, model_identity="org/model@rev-1") as first:
        first.batched_put(list(zip(keys, data, strict=True)))
    files = sorted(p.name for p in (tmp_path / "disk").iterdir() if "@" in p.name)
    assert len(files) == 3 and all("~" in f.split("@")[0] for f in files)
    with LocalDiskBackend(tmp_path / "disk", 1 << 20, model_identity="org/model@rev-1") as again:
        assert [as_bytes(c) for c in again.batched_get(keys)] == data  # the same identity: every hit
    with LocalDiskBackend(tmp_path / "disk", 1 << 20, model_identity="org/model@rev-2") as other:
        assert other.batched_get(keys) == [None] * 3 and other.list() == []
        # not for this identity: kept (a rollback finds them), in the bound, evicted first (issue 29 item 2)
        assert sorted(p.name for p in (tmp_path / "disk").iterdir() if "@" in p.name) == files


def test_an_engines_resolved_config_counts_whole_nested_configs_included() -> None:
    """vLLM's and SGLang's ``ModelConfig``: its ``hf_config`` whole (a multimodal model's
    ``text_config`` and ``vision_config`` too), its quantization and dtype, the KV fields."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    from kvbucket.integrations.engine_identity import from_model_config

    def engine(**text: object) -> object:
        hf = transformers.Gemma3Config(text_config={"sliding_window": 512, **text},
                                       vision_config={"patch_size": 14})
        hf._commit_hash = "c" * 40
        return SimpleNamespace(hf_config=hf, hf_text_config=hf.text_config, model="org/g", revision=None,
                               quantization=None, dtype="bfloat16", max_model_len=4096)

    kv = {"kv_cache_dtype": "auto"}
    base = from_model_config("org/g", engine(), kv)
    assert base.weights == "hub:" + "c" * 40 and base.fields["text_config"]["sliding_window"] == 512
    others = [from_model_config("org/g", engine(sliding_window=1024), kv),
              from_model_config("org/g", engine(rms_norm_eps=1e-5), kv),
              from_model_config("org/g", engine(), {"kv_cache_dtype": "fp8"})]
    assert len({base.token, *(o.token for o in others)}) == 4
    assert from_model_config("org/g", engine(), kv).token == base.token


def test_weights_only_in_a_subfolder_are_the_weights(tmp_path: Path) -> None:
    """``original/model.safetensors`` alone (as several Hub repos ship it): the weights part is
    its digest, not empty (the identity is not the config's alone)."""
    from kvbucket.testing.identity_models import write_safetensors

    d = tmp_path / "m"
    (d / "original").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    write_safetensors(d / "original" / "model.safetensors", seed=1)
    first = identity_of_dir(d, "org/m")
    assert first.weights.startswith("files:")
    write_safetensors(d / "original" / "model.safetensors", seed=2)
    assert identity_of_dir(d, "org/m").token != first.token
