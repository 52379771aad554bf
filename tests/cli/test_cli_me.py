"""Issue 40 item 4: the namespace ``me`` is the caller, as for ``hf`` (huggingface_hub 2.4 sends
``me`` to the Hub, which reads it as the token's user): ``hf buckets create me/x`` and ``kvbucket``
name the same bucket, in every place a bucket id or ``hf://buckets/me/...`` is read. Each step
runs the installed ``hf`` and ``kvbucket`` console scripts against the Hub emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

HF = Path(sys.executable).with_name("hf")


@pytest.fixture
def me_env(hub_emulator: Any, cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**cli_env, "HF_ENDPOINT": hub_emulator.endpoint, "HF_TOKEN": hub_emulator.write_token,
            "HF_HOME": str(tmp_path / "hf-home"), "HF_XET_CACHE": str(tmp_path / "xet"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def hf(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(HF), *args], capture_output=True, text=True, env={**os.environ, **env},
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_me_is_the_caller_for_hf_and_kvbucket(hub_emulator: Any, me_env: dict[str, str],
                                              tmp_path: Path) -> None:
    name = f"me-{uuid.uuid4().hex[:8]}"
    user = hub_emulator.namespace
    hf("buckets", "create", f"me/{name}", "--private", env=me_env)  # hf: creates <user>/<name>
    (tmp_path / "note.txt").write_bytes(b"hello")
    hf("buckets", "cp", str(tmp_path / "note.txt"), f"hf://buckets/{user}/{name}/notes/note.txt", env=me_env)
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--keep", "--target", f"hf://buckets/me/{name}/kv",
                env=me_env, timeout=300)
    assert r.code == 0, r.out + r.err

    ls = run_cli("ls", f"me/{name}", "-q", env=me_env)
    assert ls.code == 0, ls.err
    assert "notes/note.txt" in ls.out.split() and any(n.startswith("kv/") for n in ls.out.split()), ls.out
    du = run_cli("du", f"hf://buckets/me/{name}", "--json", env=me_env)
    assert du.code == 0 and json.loads(du.out)["objects"] == len(ls.out.split()), du.out + du.err
    ver = run_cli("verify", f"me/{name}/kv", "--json", env=me_env)
    assert ver.code == 0 and json.loads(ver.out)["url"] == f"hf://buckets/{user}/{name}/kv", ver.out + ver.err
    rm = run_cli("rm", f"me/{name}", "notes/note.txt", env=me_env)
    assert rm.code == 0 and "removed 1" in rm.out, rm.out + rm.err
    listed = hf("buckets", "ls", f"{user}/{name}", "-R", "--format", "json", env=me_env).stdout
    assert "note.txt" not in listed and "kv/" in listed, listed

    # the library: open_store and an engine config's remote_url read `me` the same way
    (tmp_path / "engine.yaml").write_text(f"chunk_size: 8\nlocal_cpu: false\nremote_url: hf://buckets/me/{name}/kv\n")
    code = (f"from kvbucket.stores import open_store\n"
            f"from kvbucket.chunks import KVLayout\n"
            f"from kvbucket.config import build_backend, load_engine_config\n"
            f"s = open_store('hf://buckets/me/{name}/kv')\n"
            f"print(s.url, len(list(s.list())))\n"
            f"cfg = load_engine_config('{tmp_path / 'engine.yaml'}')\n"
            f"b = build_backend(cfg, KVLayout(2, 2, 64, 'bfloat16', 8))\n"
            f"print(b.store.url)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **me_env})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split()
    assert lines[0] == f"hf://buckets/{user}/{name}/kv" and int(lines[1]) > 0, p.stdout
    assert lines[2] == f"hf://buckets/{user}/{name}/kv", p.stdout  # an engine config's remote_url


def test_me_without_a_token_or_with_a_refused_one(me_env: dict[str, str]) -> None:
    r = run_cli("ls", "me/kv", env={**me_env, "HF_TOKEN": ""})
    line = assert_one_line_error(r, 2, "'me'", "no token")
    assert "hf buckets create me/kv" not in line  # on main: a loop back to `hf buckets create me/x`
    r = run_cli("ls", "me/kv", env={**me_env, "HF_TOKEN": "hf_refused_me_0123456789"})
    assert_one_line_error(r, 2, "$HF_TOKEN", "invalid or expired")
