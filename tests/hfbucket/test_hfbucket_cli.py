"""``kvbucket ls|du|rm hf://buckets/...`` on the emulator, configured only by HF_ENDPOINT/HF_TOKEN."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from typer.testing import CliRunner

from kvbucket.cli import build_app
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore

runner = CliRunner()
KEY = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, -0x41257AF1DD85C366, "bfloat16")


def run(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(build_app(), list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def filled(hub_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    hub = hub_bucket.hub
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.write_token)
    url = f"hf://buckets/{hub_bucket.bucket_id}/kv"
    with HFBucketStore(HFBucketConfig(bucket_handle=url)) as s:
        s.put_many([(key_to_name(KEY), b"x" * 2048), ("plain/a.bin", b"abc"), ("plain/b.bin", b"de")])
    return url


def test_ls_du_with_keys(filled: str) -> None:
    code, out, _ = run("ls", filled)
    assert code == 0
    lines = sorted(out.splitlines())
    assert any(line.endswith("plain/a.bin") and line.split()[0] == "3" for line in lines)
    code, out, _ = run("ls", filled, "--keys")
    assert code == 0 and KEY.to_string() in out
    code, out, _ = run("du", filled)
    assert code == 0 and "3 objects, 2053 bytes" in out
    code, out, _ = run("du", filled, "--prefix", "plain/")
    assert code == 0 and "2 objects, 5 bytes" in out


def test_rm_names_and_prefix(filled: str) -> None:
    code, out, _ = run("rm", filled, "plain/a.bin", "plain/missing")
    assert code == 0 and "removed 1, 1 not found" in out
    code, _, err = run("rm", filled, "--prefix", "plain/")
    assert code == 2 and "--yes" in err
    code, out, _ = run("rm", filled, "--prefix", "plain/", "--yes")
    assert code == 0 and "removed 1" in out
    code, out, _ = run("du", filled)
    assert "1 object, 2048 bytes" in out


def test_cli_errors_are_one_line_and_never_create(hub_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub_emulator.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_emulator.write_token)
    missing = f"{hub_emulator.namespace}/nope-{uuid.uuid4().hex[:8]}"
    code, _, err = run("ls", f"hf://buckets/{missing}")
    assert code == 2 and missing in err and "Traceback" not in err
    code, _, err = run("ls", "hf://buckets/only-namespace")
    assert code == 2 and "names no bucket" in err
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_cli_token_000")
    code, _, err = run("du", f"hf://buckets/{missing}")
    assert code == 2 and "hf_wrong_cli_token_000" not in err


def test_demo_targets_a_bucket(hub_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = hub_bucket.hub
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.write_token)
    url = f"hf://buckets/{hub_bucket.bucket_id}/demo"
    code, out, err = run(
        "demo", "--synthetic", "--target", url, "--chunks", "4", "--model", "qwen2.5-0.5b", "--keep"
    )
    assert code == 0, err
    assert hub.write_token not in out + err
    with HFBucketStore(HFBucketConfig(bucket_handle=url)) as s:
        listed = list(s.list())
    assert len(listed) == 4 and len({i.size for i in listed}) == 1  # four full chunks landed
    code, _, err = run(
        "demo", "--synthetic", "--target", url + "2", "--chunks", "2", "--model", "qwen2.5-0.5b"
    )
    assert code == 0, err
    with HFBucketStore(HFBucketConfig(bucket_handle=url + "2")) as s:
        assert list(s.list()) == []  # cleaned up without --keep
