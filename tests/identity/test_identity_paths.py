"""An outside tester's attacks on model identity (issue 38, F1-F7): what a model path is, which
files count, and what is never "the same". Unknown means a miss, never the old identity: a path
setting is never text, a directory with no weights or an unreadable entry is not known, a copy
of a Hub snapshot is hashed, a ``dtype`` spelt twice follows transformers. Each redeploy below
is computed before and after in a fresh process sharing the machine's digest cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvbucket.errors import ConfigError
from kvbucket.identity import core
from kvbucket.identity.core import IdentityPending, IdentitySetting, config_fields, identity_of_dir, token_of
from kvbucket.identity.files import ModelFilesError, NoWeightsError, hub_snapshot_commit
from kvbucket.identity.weights import hub_commit
from kvbucket.integrations.engine_identity import IdentitySettings, from_files, resolve
from kvbucket.testing.identity_models import COMMITS, hub_snapshot, write_safetensors

# For each model_identity setting on stdin: its weights part, or "pending: <why>" when not known.
SCRIPT = """
import json, sys
from kvbucket.identity.core import IdentitySetting
out = {}
for text in json.load(sys.stdin):
    s = IdentitySetting(text)
    try:
        s.wait(60)
        ident = s.identity("org/m")
        out[text] = {"weights": ident.weights, "token": ident.token}
    except Exception as e:
        out[text] = {"pending": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""
KV: dict[str, Any] = {"kv_cache_dtype": "bfloat16"}


def fresh(cache: Path, *settings: str, caps: bool = True) -> dict[str, dict[str, str]]:
    """Each setting's identity in a fresh process; ``caps=False``: root without its file
    capabilities (DAC override), so file permissions apply to it as to any user."""
    env = {**os.environ, "KVBUCKET_IDENTITY_CACHE": str(cache)}
    drop = [] if caps else ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    out = subprocess.run([*drop, sys.executable, "-c", SCRIPT], input=json.dumps(settings),
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    return dict(json.loads(out.stdout))


def model(root: Path, seed: int = 1, config: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 64}))
    write_safetensors(root / "model.safetensors", seed)
    return root


def settle() -> None:
    time.sleep(1.1)  # past RACY_NS: the first process keeps the digests (a change must not hide)


# ---- F1: a setting that names a path is that path, never text ---------------------------------

def test_a_missing_path_setting_is_not_known_never_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(core, "RETRY_S", 0.0)
    where = tmp_path / "not-mounted-yet"
    with caplog.at_level(logging.ERROR, logger="kvbucket.identity"):
        setting = IdentitySetting(str(where))
    assert f"model identity of {where} cannot be computed" in caplog.text and "does not exist" in caplog.text
    assert setting.unknown(2) and not setting.ready()
    with pytest.raises(IdentityPending, match=r"is not known: .*does not exist") as pending:
        setting.identity("meta/m")
    assert "being computed" not in str(pending.value)
    with pytest.raises(ConfigError, match="does not exist"):
        setting.wait(5)
    model(where)  # mounted: tried again, then known by its files
    assert setting.wait(30)
    ident = setting.identity("meta/m")
    assert ident is not None and ident.weights.startswith("files:")
    assert ident.token == identity_of_dir(where, "meta/m").token


def test_relative_and_home_paths_are_paths_and_labels_stay_labels(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    d = model(tmp_path / "models" / "m")
    want = identity_of_dir(d, "org/m").token
    for text in ("./models/m", "~/models/m", str(d)):
        s = IdentitySetting(text)
        assert s.wait(30) and s.token("org/m") == want, text
    for text in ("./models/absent", "~/absent"):
        s = IdentitySetting(text)
        with pytest.raises(IdentityPending):
            s.token("org/m")
    # a label (and a token as `kvbucket du` shows it) is text, as documented
    label = IdentitySetting("v3").identity("org/m")
    assert label is not None and label.weights == "set:v3" and label.token == token_of("v3")
    assert IdentitySetting(want).token("org/m") == want
    # an engine tier's setting: a missing path is an error at start, never text
    with pytest.raises(ModelFilesError, match="does not exist"):
        resolve("t", "org/m", IdentitySettings(model_identity=str(tmp_path / "absent")), KV)


def test_a_single_weights_file_is_hashed_and_a_redeploy_at_its_path_is_a_new_identity(tmp_path: Path) -> None:
    gg = tmp_path / "gg"
    gg.mkdir()
    f = gg / "model.gguf"
    f.write_bytes(b"GGUF" + os.urandom(1 << 16))
    (gg / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 10000.0}))
    (gg / "other.gguf").write_bytes(b"GGUF" + os.urandom(1 << 10))  # another file beside: not in it
    cache = tmp_path / "cache.json"
    settle()
    before = fresh(cache, str(f))[str(f)]
    assert before["weights"].startswith("files:"), before
    ident = identity_of_dir(f, "org/m")
    assert ident.fields["rope_theta"] == 10000.0 and ident.token == before["token"]
    (gg / "other.gguf").write_bytes(b"GGUF other")
    assert fresh(cache, str(f))[str(f)]["token"] == before["token"]
    with open(f, "r+b") as w:  # the same path, other weights
        w.seek(1 << 15)
        w.write(b"\x01" * 64)
    after = fresh(cache, str(f))[str(f)]
    assert after["weights"].startswith("files:") and after["token"] != before["token"]


# ---- F2: a directory with no weights is not known; directory symlinks are followed -------------

def test_a_directory_without_weights_is_not_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text('{"model_type": "llama"}')
    absent = tmp_path / "absent"
    for d in (empty, config_only):
        with pytest.raises(NoWeightsError, match=f"no weight file under {d}"):
            identity_of_dir(d, "org/m")
    with pytest.raises(ModelFilesError, match="does not exist"):
        identity_of_dir(absent, "org/m")
    got = fresh(tmp_path / "cache.json", str(empty), str(config_only), str(absent))
    assert all("pending" in v and "weights" not in v for v in got.values()), got
    assert "no weight file" in got[str(config_only)]["pending"]
    # the engine path keeps its rule: no weights -> name-only, with a warning
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        assert from_files(str(config_only), None, KV) is None
    assert "no weight file" in caplog.text


def test_weights_behind_a_directory_symlink_count_and_a_cycle_ends(tmp_path: Path) -> None:
    d = model(tmp_path / "m")
    target = tmp_path / "dl_target"
    target.mkdir()
    write_safetensors(target / "extra.safetensors", seed=5)
    (d / "weights").symlink_to("../dl_target")
    (d / "loop").symlink_to(".")  # a cycle: walked once, never forever
    only_link = tmp_path / "only-link"
    only_link.mkdir()
    (only_link / "weights").symlink_to("../dl_target")
    cache = tmp_path / "cache.json"
    settle()
    before = fresh(cache, str(d), str(only_link))
    assert before[str(only_link)]["weights"].startswith("files:"), before
    write_safetensors(target / "extra.safetensors", seed=6)  # the weights behind the link redeployed
    after = fresh(cache, str(d), str(only_link))
    assert all(after[k]["token"] != before[k]["token"] for k in after), (before, after)


# ---- F4: an unreadable entry makes the identity unknown, never skipped -------------------------

def test_an_unreadable_subdirectory_or_entry_is_not_known(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("drops root's file capabilities with setpriv")
    d = model(tmp_path / "m")
    (d / "original").mkdir()
    write_safetensors(d / "original" / "model.safetensors", seed=3)
    e = model(tmp_path / "e")
    (e / "sub").mkdir()
    write_safetensors(e / "sub" / "model.safetensors", seed=4)
    cache = tmp_path / "cache.json"
    assert all("weights" in v for v in fresh(cache, str(d), str(e), caps=False).values())
    (d / "original").chmod(0o000)  # cannot be listed
    (e / "sub").chmod(0o600)  # listed, but its entries cannot be stat'ed
    try:
        got = fresh(cache, str(d), str(e), caps=False)
    finally:
        (d / "original").chmod(0o755)
        (e / "sub").chmod(0o755)
    assert "cannot list" in got[str(d)].get("pending", ""), got
    assert "cannot stat" in got[str(e)].get("pending", ""), got
    (tmp_path / "dangling").mkdir()
    model(tmp_path / "dangling")
    (tmp_path / "dangling" / "params.json").symlink_to("gone.json")
    with pytest.raises(ModelFilesError, match="broken symlink"):
        identity_of_dir(tmp_path / "dangling", "org/m")


# ---- F6: a Hub snapshot only where huggingface_hub's cache layout is --------------------------

def test_only_a_real_hub_cache_snapshot_is_a_commit(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    real = hub_snapshot(tmp_path / "hub" / "models--org--m", COMMITS[0], src)
    assert hub_snapshot_commit(real) == COMMITS[0] and identity_of_dir(real).weights == f"hub:{COMMITS[0]}"
    assert hub_commit(real / "model.safetensors") is None  # one file of it: hashed
    copy = tmp_path / "mine" / "snapshots" / COMMITS[1]  # a user's copy, no models--*, regular files
    model(copy)
    lookalike = tmp_path / "hub2" / "models--org--m" / "snapshots" / COMMITS[1]  # the layout, copied files
    model(lookalike)
    (lookalike.parent.parent / "blobs").mkdir()
    cache = tmp_path / "cache.json"
    settle()
    before = fresh(cache, str(copy), str(lookalike), str(real))
    assert before[str(real)]["weights"] == f"hub:{COMMITS[0]}"
    assert all(before[str(d)]["weights"].startswith("files:") for d in (copy, lookalike)), before
    for d in (copy, lookalike):
        write_safetensors(d / "model.safetensors", seed=9)
    after = fresh(cache, str(copy), str(lookalike))
    assert all(after[k]["token"] != before[k]["token"] for k in after)
    # one file of a real snapshot replaced by a regular file: no longer what the commit says
    (real / "model.safetensors").unlink()
    write_safetensors(real / "model.safetensors", seed=9)
    assert identity_of_dir(real).weights.startswith("files:")
    # transformers takes any snapshots/<hex>/ in a path as _commit_hash: not for a local copy
    assert hub_commit(config={"_commit_hash": COMMITS[1], "_name_or_path": str(copy)}) is None
    assert hub_commit(config={"_commit_hash": COMMITS[1], "_name_or_path": "org/m"}) == COMMITS[1]


# ---- F7: dtype and torch_dtype both set: transformers keeps dtype ------------------------------

def test_dtype_wins_over_torch_dtype_as_in_transformers() -> None:
    from transformers import LlamaConfig

    for cfg in ({"dtype": "bfloat16", "torch_dtype": "float16"},
                {"torch_dtype": "float16", "dtype": "bfloat16"}):
        loaded = LlamaConfig.from_dict({"model_type": "llama", **cfg})
        assert str(loaded.dtype) == "torch.bfloat16"
        assert config_fields(cfg) == {"dtype": "bfloat16"}
        assert config_fields(loaded)["dtype"] == "bfloat16"
    assert config_fields({"dtype": None, "torch_dtype": "float16"}) == {"dtype": "float16"}
    assert str(LlamaConfig.from_dict({"dtype": None, "torch_dtype": "float16"}).dtype) == "torch.float16"
