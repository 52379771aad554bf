"""A lone AWS key in a config is refused, never completed from the environment (issue 40 F4).

``extra_config: {aws_secret_access_key: wrong}`` with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in
the environment: the engine and ``open_store`` replaced the lone key with the environment's pair
and worked, where the L2 parser and docs/s3.md say "both or neither". One rule, one function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvbucket.errors import ConfigError
from kvbucket.stores import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_run import run_cli

ENV = {"AWS_ACCESS_KEY_ID": "AKIAENVIRONMENT", "AWS_SECRET_ACCESS_KEY": "environment-secret",
       "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "us-east-1"}  # fmt: skip


@pytest.mark.parametrize("key", ["aws_secret_access_key", "aws_access_key_id"])
def test_open_store_refuses_a_lone_key(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="both aws_access_key_id and aws_secret_access_key"):
        open_store("s3://kvb/p", **{key: "wrong"})


@pytest.mark.parametrize("key", ["aws_secret_access_key", "aws_access_key_id"])
def test_an_engine_config_with_a_lone_key_is_refused(key: str, tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(f"chunk_size: 256\nremote_url: s3://kvb/bad\nextra_config:\n  {key}: wrong\n")
    r = run_cli("demo", "--synthetic", "--chunks", "1", "--model", "qwen2.5-0.5b", "--config", str(config),
                env=ENV, cwd=tmp_path, timeout=60)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "both aws_access_key_id and aws_secret_access_key" in r.err, r.err
    assert "wrong" not in r.err + r.out and "environment-secret" not in r.err + r.out
