"""``kvbucket --version``, shell completion and ``kvbucket doctor``, run as the installed script."""

from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

import kvbucket

SENTINELS = {
    "HF_TOKEN": "hf_doctor_sentinel_0123456789",
    "AWS_SECRET_ACCESS_KEY": "aws-doctor-sentinel-secret",
    "AWS_SESSION_TOKEN": "aws-doctor-sentinel-session",
    "KVBUCKET_EMULATOR_ADMIN_KEY": "admin-sentinel",
}


def test_version(cli_env: dict[str, str]) -> None:
    r = run_cli("--version", env=cli_env)
    assert r.code == 0 and r.out.strip() == f"kvbucket {kvbucket.__version__}"
    assert run_cli("version", env=cli_env).out.strip() == kvbucket.__version__


def test_shell_completion(cli_env: dict[str, str]) -> None:
    r = run_cli("--show-completion", "bash", env=cli_env)
    assert r.code == 0 and "_KVBUCKET_COMPLETE" in r.out and "complete" in r.out
    # what bash asks the script when the user presses TAB after `kvbucket compile-cache s`
    env = {**cli_env, "_KVBUCKET_COMPLETE": "complete_bash", "COMP_WORDS": "kvbucket compile-cache s",
           "COMP_CWORD": "2"}
    r = run_cli(env=env)
    assert r.code == 0 and r.out.split() == ["set", "sync", "status"]
    env.update(COMP_WORDS="kvbucket d", COMP_CWORD="1")
    assert set(run_cli(env=env).out.split()) == {"demo", "du", "doctor"}


def test_install_completion_writes_the_shell_rc(cli_env: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    r = run_cli("--install-completion", "bash", env={**cli_env, "HOME": str(home), "SHELL": "/bin/bash"})
    assert r.code == 0, r.err
    assert "kvbucket" in (home / ".bashrc").read_text()


def test_doctor_prints_versions_and_redacts_secrets(hub_bucket: Any, cli_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    hub = hub_bucket.hub
    env = {**cli_env, **SENTINELS, "HF_TOKEN": hub.write_token, "HF_ENDPOINT": hub.endpoint,
           "HF_HOME": str(tmp_path / "hf"), "AWS_ACCESS_KEY_ID": "AKIADOCTORSENTINEL",
           "KVBUCKET_EXTRA_CONFIG": '{"aws_secret_access_key": "extra-config-sentinel"}',
           "KVBUCKET_COMPILE_CACHE": str(tmp_path)}
    url = f"hf://buckets/{hub_bucket.bucket_id}"
    r = run_cli("doctor", url, env=env)
    assert r.code == 0, r.out + r.err
    for name in ("kvbucket", "huggingface_hub", "hf_xet", "obstore", "lmcache", "torch"):
        assert f"  {name:<18}{metadata.version(name)}" in r.out.splitlines(), name
    for secret in (*SENTINELS.values(), hub.write_token, "AKIADOCTORSENTINEL", "extra-config-sentinel"):
        assert secret not in r.out + r.err
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "KVBUCKET_EXTRA_CONFIG"):
        assert any(ln.split() == [name, "set", "(redacted)"] for ln in r.out.splitlines()), name
    assert f"HF_ENDPOINT                 {hub.endpoint}" in r.out
    assert f"ok    $HF_ENDPOINT {hub.endpoint}: answered HTTP" in r.out
    assert f"ok    {url} (command line): answered a listing" in r.out
    assert f"ok    {tmp_path} ($KVBUCKET_COMPILE_CACHE): answered a listing" in r.out


def test_doctor_reports_unreachable_stores_and_exits_1(
    silent_port: int, cli_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**cli_env, "HF_ENDPOINT": f"http://127.0.0.1:{silent_port}", "HF_TOKEN": SENTINELS["HF_TOKEN"],
           "HF_HOME": str(tmp_path / "hf")}
    t0 = time.monotonic()
    r = run_cli("doctor", "hf://buckets/a/b", str(tmp_path / "absent"), "--timeout", "1", env=env)
    assert r.code == 1 and "Traceback" not in r.err
    assert time.monotonic() - t0 < 60
    lines = r.out.splitlines()
    assert any(ln.startswith("  FAIL  $HF_ENDPOINT") and "unreachable" in ln for ln in lines), r.out
    assert any(ln.startswith("  FAIL  hf://buckets/a/b (command line): no answer") for ln in lines), r.out
    assert any(ln.startswith(f"  FAIL  {tmp_path / 'absent'} (command line): cannot open") for ln in lines)
    assert SENTINELS["HF_TOKEN"] not in r.out + r.err


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--timeout", "0.5"]])
def test_doctor_with_nothing_configured(args: list[str], cli_env: dict[str, str], tmp_path: Path) -> None:
    r = run_cli(*args, env={**cli_env, "HF_HOME": str(tmp_path / "hf")})
    assert r.code == 0 and "nothing configured" in r.out
