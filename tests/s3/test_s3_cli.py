"""``kvbucket ls|du|rm s3://...`` configured by the standard AWS env vars only (no config file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbucket.cli import build_app
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import S3Server

KEY = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, -0x41257AF1DD85C366, "bfloat16")
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def filled(seaweedfs: S3Server, s3_bucket: str) -> str:
    with S3Store(S3Config.parse(seaweedfs.config(s3_bucket, "cache"))) as store:
        store.put_many(
            [(key_to_name(KEY, "kv"), b"x" * 2048), ("plain/a.bin", b"z" * 5), ("plain/b.bin", b"q")]
        )
    return f"s3://{s3_bucket}/cache"


@pytest.fixture
def aws_env(seaweedfs: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for k in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    return seaweedfs.env()


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(build_app(), list(args))
    return result.exit_code, result.stdout, result.stderr


def test_ls_du_rm_with_env_vars_only(filled: str, aws_env: dict[str, str]) -> None:
    code, out, _ = run("ls", filled)
    assert code == 0
    assert sorted(line.split()[-1] for line in out.splitlines()) == sorted(
        [key_to_name(KEY, "kv"), "plain/a.bin", "plain/b.bin"]
    )
    code, out, _ = run("ls", filled, "--keys", "--prefix", "kv/")
    assert code == 0 and KEY.to_string() in out
    code, out, _ = run("du", filled)
    assert code == 0 and out.startswith("3 objects, 2054 bytes")
    code, out, _ = run("rm", filled, "plain/a.bin", "plain/nope")
    assert code == 0 and "removed 1" in out and "1 not found" in out
    code, out, _ = run("rm", filled, "--prefix", "plain/", "--yes")
    assert code == 0 and "removed 1" in out
    code, out, _ = run("du", filled)
    assert out.startswith("1 object") and "2048 bytes" in out


def test_cli_reports_a_missing_bucket_and_bad_credentials(
    filled: str, aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run("ls", "s3://no-such-bucket-cli")
    assert code != 0 and "does not exist" in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    code, out, err = run("ls", filled)
    assert code != 0 and "refused" in err and "wrong-secret-value" not in out + err


def test_kvbucket_ls_subprocess(filled: str, aws_env: dict[str, str]) -> None:
    env = {**os.environ, **aws_env, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-m", "kvbucket", "ls", filled, "--prefix", "plain/"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[-1] for line in proc.stdout.splitlines()] in (
        ["plain/a.bin", "plain/b.bin"],
        ["plain/b.bin", "plain/a.bin"],
    )


def test_demo_target_s3_with_env_vars_only(
    seaweedfs: S3Server, s3_bucket: str, aws_env: dict[str, str]
) -> None:
    """kvbucket demo --target s3://bucket/prefix: the hybrid stack over S3, every byte verified."""
    code, out, err = run(
        "demo", "--target", f"s3://{s3_bucket}/demo", "--chunks", "4", "--model", "qwen2.5-0.5b"
    )
    assert code == 0, out + err
    assert f"s3://{s3_bucket}/demo" in out, out
    leftovers = seaweedfs.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    assert leftovers == [], "the demo removes its chunks unless --keep"
