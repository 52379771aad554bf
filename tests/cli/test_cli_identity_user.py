"""Issue 38, the user's side, through the installed ``kvbucket`` console script: ``du`` shows each
identity's weights and config fields from its manifest (table and JSON); ``rm --model --identity``
takes a unique prefix of a token and, when nothing or more than one identity matches (a short
token, a wrong model name, an ambiguous prefix), exits 2 naming the identities the store holds
and removes nothing. Chunks are written by real L2 adapters whose ``model_identity`` is a model
directory, on a directory and on a Hub bucket (the emulator)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

from kvbucket.identity.core import IdentitySetting
from kvbucket.identity.manifest import manifest_name
from kvbucket.keys import ObjectKey, key_to_name
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.l2.naming import Naming
from kvbucket.stores import open_store
from kvbucket.testing import l2 as t
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.identity_models import make_model_dirs

MODEL = "org/llama"
CHUNK = 512
TWINS = ("abcd000000000001", "abcd000000000002")  # two tokens sharing a 4-digit prefix


def write(url: str, models: dict[str, Path]) -> dict[str, str]:
    """3 chunks by the base model's identity, 2 by the fine-tune's, 1 name-only; each identity's
    manifest; and 1 chunk of another model under each of two tokens that share a prefix."""
    tokens: dict[str, str] = {}
    runs = (("base", str(models["base"]), 0, 3), ("weights", str(models["weights"]), 10, 2),
            ("none", None, 20, 1))
    for label, setting, first, n in runs:
        identity = IdentitySetting(setting)
        assert identity.wait(60)  # a model directory is hashed in the background first
        store = open_store(url)
        adapter = ObjectStoreL2Adapter(store, full_chunk_bytes=CHUNK, naming=Naming(identity=identity))
        keys = [ObjectKey(MODEL, 0, (first + i).to_bytes(8, "big")) for i in range(n)]
        try:
            assert t.store(adapter, keys, [bytes([i + 1]) * CHUNK for i in range(n)]).success
            if setting is not None:
                tokens[label] = identity.token(MODEL) or ""
                deadline = time.monotonic() + 30
                while store.head(manifest_name("", MODEL, tokens[label])) is None:  # written in background
                    assert time.monotonic() < deadline, "no manifest"
                    time.sleep(0.05)
        finally:
            adapter.close()
    with open_store(url) as raw:
        raw.put_many([(key_to_name(f"org/twin~{tok}@0@{i:02x}"), b"x" * 10) for i, tok in enumerate(TWINS)])
    return tokens


def check(url: str, env: dict[str, str], models: dict[str, Path]) -> None:
    tokens = write(url, models)
    r = run_cli("du", url, "--format", "json", env=env)
    assert r.code == 0, r.err
    gens = {(g["model"], g["identity"]): g for g in json.loads(r.out)["by_model_identity"]}
    base = gens[(MODEL, tokens["base"])]
    assert base["chunks"] == 3 and base["weights"].startswith("files:"), base
    assert base["fields"]["model_type"] == "llama" and base["fields"]["rope_theta"] == 10000.0
    assert base["first_write"] and base["host"]
    assert gens[(MODEL, tokens["weights"])]["weights"].startswith("files:")
    assert gens[(MODEL, tokens["weights"])]["weights"] != base["weights"]
    assert gens[(MODEL, "none")]["weights"] is None and gens[(MODEL, "none")]["chunks"] == 1
    r = run_cli("du", url, env=env)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    at = next(i for i, ln in enumerate(lines) if f"{MODEL}  {tokens['base']}: 3 chunks" in ln)
    summary = lines[at + 1].strip()
    assert summary.startswith(f"weights {base['weights']}; ") and "config fields: " in summary
    assert "model_type=llama" in summary
    before = sorted(i.name for i in open_store(url).list(""))

    # what matches nothing, or more than one identity, removes nothing and names what is there
    r = run_cli("rm", url, "--model", MODEL, "--identity", tokens["base"][:2], env=env)
    short = assert_one_line_error(r, 2, "not an identity token", tokens["base"], tokens["weights"])
    assert "none (name only)" in short
    r = run_cli("rm", url, "--model", "org/lama", "--identity", tokens["base"], env=env)
    wrong = assert_one_line_error(r, 2, "'org/lama' has no chunks", f"{MODEL} {tokens['base']} (3 chunks)")
    assert "nothing removed" in wrong
    assert_one_line_error(run_cli("rm", url, "--model", MODEL, "--identity", "0" * 16, env=env), 2,
                          "no identity of model 'org/llama' matches", tokens["base"])
    assert_one_line_error(run_cli("rm", url, "--model", "org/twin", "--identity", "abcd", env=env), 2,
                          "ambiguous", *TWINS)
    assert sorted(i.name for i in open_store(url).list("")) == before

    # a unique prefix removes that generation (its chunks and its manifest)
    r = run_cli("rm", url, "--model", MODEL, "--identity", tokens["base"][:6], "--dry-run", env=env)
    assert r.code == 0 and "(dry run) would remove 4" in r.out, (r.out, r.err)
    r = run_cli("rm", url, "--model", MODEL, "--identity", tokens["base"][:6], env=env)
    assert r.code == 0 and "removed 4" in r.out, (r.out, r.err)
    r = run_cli("rm", url, "--model", "org/twin", "--identity", TWINS[1], env=env)
    assert r.code == 0 and "removed 1" in r.out, (r.out, r.err)
    r = run_cli("du", url, "--format", "json", env=env)
    left = {(g["model"], g["identity"]) for g in json.loads(r.out)["by_model_identity"]}
    assert left == {(MODEL, tokens["weights"]), (MODEL, "none"), ("org/twin", TWINS[0])}


def test_du_and_rm_identity_on_a_directory(tmp_path: Path) -> None:
    check(str(tmp_path / "kv"), {}, make_model_dirs(tmp_path / "models"))


def test_du_and_rm_identity_on_a_hub_bucket(hub_bucket: HubBucket, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, Any] = {"HF_ENDPOINT": hub_bucket.hub.endpoint, "HF_TOKEN": hub_bucket.hub.write_token}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # this process writes the chunks as the console script reads them
    check(f"hf://buckets/{hub_bucket.bucket_id}/kv", env, make_model_dirs(tmp_path / "models"))
