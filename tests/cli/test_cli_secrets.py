"""No planted secret is ever printed: every command of the installed script (with and without
``--debug``) and every config error path, with secrets where users keep them (issue 24, items
1-3).

Planted: a JSON keyring of base64 AES-256 keys (``$KVBUCKET_KEYRING`` and a keyring file),
``HF_TOKEN`` (the emulator's real write token), ``AWS_SECRET_ACCESS_KEY`` (SeaweedFS's real
secret) and ``AWS_SESSION_TOKEN``, passwords in the userinfo of ``HF_ENDPOINT`` and
``AWS_ENDPOINT_URL``, and tokens under misspelt keys of an engine YAML, an L2 adapter JSON, and
SGLang's and vLLM's settings. The commands run twice: with the passwords in the endpoints (every
store refuses: the error paths) and with plain endpoints (the commands work: DEBUG logs of real
Hub and S3 traffic, Xet tokens included, must hold no credential either).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import typer
from cli_run import Run, run_cli, start_cli

from kvbucket.cli import build_app
from kvbucket.errors import ConfigError
from kvbucket.secrets import looks_secret, redact, secrets_in_env
from kvbucket.testing.s3_server import S3Server

XET_TOKEN = re.compile(r"xet_[\w-]{8,}\.[\w.-]+|eyJ[\w-]{6,}\.[\w-]+")


def _key() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


class Plants:
    """The planted secrets (label -> value) and the files holding some of them."""

    def __init__(self, tmp: Path, hub: Any, s3: S3Server) -> None:
        self.keyring_keys = [_key(), _key()]
        self.keyring = {"tenants": {"team-a": {"1": self.keyring_keys[0], "2": self.keyring_keys[1]}}}
        self.hf_pw, self.aws_pw = f"hfpw-{secrets.token_hex(8)}", f"awspw-{secrets.token_hex(8)}"
        self.session = f"session-{secrets.token_hex(12)}"
        self.config_tokens = {k: f"{k}-{secrets.token_hex(10)}" for k in (
            "yaml-token", "yaml-aws", "yaml-extra", "yaml-url-pw", "l2-token", "l2-aws", "l2-nested",
            "sglang-token", "sglang-aws", "sglang-fleet", "vllm-token", "vllm-aws", "vllm-options",
            "keyfile-key", "stats-pw", "cli-url-pw")}
        self.values: dict[str, str] = {
            "keyring key 1": self.keyring_keys[0], "keyring key 2": self.keyring_keys[1],
            "HF_TOKEN": hub.write_token, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_SESSION_TOKEN": self.session,
            "password in HF_ENDPOINT": self.hf_pw, "password in AWS_ENDPOINT_URL": self.aws_pw,
            **self.config_tokens,
        }
        tok = self.config_tokens
        # an engine config with tokens under misspelt keys and a password in a URL
        self.engine_yaml = tmp / "engine.yaml"
        self.engine_yaml.write_text(
            f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\ntoken: {tok['yaml-token']}\n"
            f"aws_secret_acess_key: {tok['yaml-aws']}\n"
            f"remote_url: 'hf://buckets/kvtest/x?password={tok['yaml-url-pw']}'\n"
            f"extra_config: {{hf_tokn: {tok['yaml-extra']}, unsealed: {tok['yaml-extra']}}}\n")
        self.broken_yaml = tmp / "broken.yaml"
        self.broken_yaml.write_text(f"chunk_size: 256\nhf_token: \"{tok['yaml-token']}\n  : [\n")
        self.keyring_file = tmp / "keys.json"
        self.keyring_file.write_text(json.dumps({"tenants": {"team-a": {"one": tok["keyfile-key"]}}}))
        self.keyring_file.chmod(0o600)

    def found_in(self, text: str) -> list[str]:
        leaked = [label for label, v in self.values.items() if v in text]
        if XET_TOKEN.search(text):
            leaked.append(f"a Xet token ({XET_TOKEN.search(text).group()[:8]}...)")  # type: ignore[union-attr]
        return leaked


@pytest.fixture
def plants(tmp_path: Path, hub_emulator: Any, seaweedfs: S3Server) -> Plants:
    return Plants(tmp_path, hub_emulator, seaweedfs)


def _with_userinfo(url: str, user: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"


def _env(p: Plants, hub: Any, s3: S3Server, tmp: Path, cli_env: dict[str, str], *,
         userinfo: bool) -> dict[str, str]:
    s3_env = s3.env()
    return {
        **cli_env, **s3_env,
        "HF_TOKEN": hub.write_token, "AWS_SESSION_TOKEN": p.session if userinfo else "",
        "HF_ENDPOINT": _with_userinfo(hub.endpoint, "someone", p.hf_pw) if userinfo else hub.endpoint,
        "AWS_ENDPOINT_URL": (_with_userinfo(s3_env["AWS_ENDPOINT_URL"], "someone", p.aws_pw) if userinfo
                             else s3_env["AWS_ENDPOINT_URL"]),
        "KVBUCKET_KEYRING": json.dumps(p.keyring), "KVBUCKET_TIMEOUT": "10",
        "HF_HOME": str(tmp / "hf-home"), "HF_XET_CACHE": str(tmp / "xet"), "COLUMNS": "200",
        "KVBUCKET_COMPILE_CACHE": "", "NEURON_CC_FLAGS": f"--cache_dir={tmp / 'neuron'}",
    }


def _commands(p: Plants, hub_url: str, s3_url: str, tmp: Path) -> list[list[str]]:
    """Every command, each with arguments that make it reach its stores and configs."""
    cache = str(tmp / "compile-cache")
    tok = p.config_tokens
    return [
        ["version"],
        ["doctor", hub_url, s3_url, "--timeout", "5"],
        ["stats", "--url", f"http://someone:{tok['stats-pw']}@127.0.0.1:9/metrics"],
        ["ls", hub_url], ["ls", s3_url], ["du", hub_url], ["du", s3_url],
        ["ls", f"s3://someone:{tok['cli-url-pw']}@bucket/x"],
        ["rm", hub_url, "absent-object"], ["rm", s3_url, "absent-object"],
        ["verify", hub_url, "--keyring-file", str(p.keyring_file)], ["verify", s3_url],
        ["migrate", hub_url, "--dry-run"], ["migrate", s3_url, "--keyring-file", str(p.keyring_file)],
        ["demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--target", hub_url],
        ["demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--target", s3_url],
        ["demo", "--synthetic", "--chunks", "1", "--config", str(p.engine_yaml)],
        ["demo", "--synthetic", "--chunks", "1", "--config", str(p.broken_yaml)],
        ["demo", "--target", "ftp://someone:" + tok["cli-url-pw"] + "@x/y"],
        ["compile-cache", "create", hub_url, "--no-set"], ["compile-cache", "create", s3_url, "--no-set"],
        ["compile-cache", "set", hub_url],
        ["compile-cache", "fetch", "--layout", "torch", "--cache-dir", cache, "--target", hub_url],
        ["compile-cache", "sync", "--layout", "torch", "--cache-dir", cache, "--target", s3_url],
        ["compile-cache", "lookup", "org/model", "--target", hub_url],
        ["compile-cache", "status", "--layout", "directory:cache", "--cache-dir", cache],
        ["compile-cache", "cleanup", "--layout", "directory:cache", "--cache-dir", cache, "--dry-run"],
        ["emulator", "serve", "--port", "1", "--token", f"me={tok['cli-url-pw']}:write"],
        ["emulator", "collect", "--endpoint", f"http://someone:{tok['cli-url-pw']}@127.0.0.1:9"],
    ]


def _command_paths() -> set[tuple[str, ...]]:
    paths: set[tuple[str, ...]] = set()

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs is None:
            paths.add(path)
        for name, sub in (subs or {}).items():
            if not sub.hidden:
                walk(sub, (*path, name))

    walk(typer.main.get_command(build_app()), ())
    return paths


def _run_all(cmds: list[list[str]], env: dict[str, str], cwd: Path) -> list[tuple[list[str], Run]]:
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda a: (a, run_cli(*a, env=env, timeout=180, cwd=cwd)), cmds))


def _leaks(p: Plants, runs: list[tuple[list[str], Run]]) -> list[str]:
    return [f"`kvbucket {' '.join(a)}` (exit {r.code}) printed {', '.join(found)}"
            for a, r in runs if (found := p.found_in(r.out + r.err))]


@pytest.mark.slow(25)
def test_no_planted_secret_in_any_output_of_any_command(
    plants: Plants, hub_bucket: Any, s3_bucket: str, seaweedfs: S3Server, cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Passwords in both endpoints: every store refuses, so this sweeps the error paths, plain and
    with ``--debug`` (logs of the clients' requests, tracebacks)."""
    hub_url, s3_url = f"hf://buckets/{hub_bucket.bucket_id}/sweep", f"s3://{s3_bucket}/sweep"
    env = _env(plants, hub_bucket.hub, seaweedfs, tmp_path, cli_env, userinfo=True)
    cmds = _commands(plants, hub_url, s3_url, tmp_path)
    missing = {p for p in _command_paths() if not any(tuple(c[:len(p)]) == p for c in cmds)}
    assert not missing, f"commands the sweep does not run: {sorted(missing)}"
    runs = _run_all([*cmds, *(["--debug", *c] for c in cmds)], env, tmp_path)
    assert not (leaks := _leaks(plants, runs)), "\n".join(leaks)
    by_args = {tuple(a): r for a, r in runs}
    assert by_args[("ls", hub_url)].code == 2  # the password reached the client, and the Hub refused
    assert "***@" in by_args[("--debug", "ls", hub_url)].err  # httpx's request log line, redacted


def test_no_secret_in_the_debug_logs_of_working_commands(
    plants: Plants, hub_bucket: Any, s3_bucket: str, seaweedfs: S3Server, cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Plain endpoints: the commands that move data work, and their DEBUG logs of real Hub and S3
    traffic (Xet tokens, signed URLs) hold no credential."""
    hub_url, s3_url = f"hf://buckets/{hub_bucket.bucket_id}/sweep", f"s3://{s3_bucket}/sweep"
    env = _env(plants, hub_bucket.hub, seaweedfs, tmp_path, cli_env, userinfo=False)
    demo = ["demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--keep", "--target"]
    cmds = [[*demo, hub_url], [*demo, s3_url], ["ls", hub_url], ["du", s3_url], ["verify", hub_url],
            ["migrate", s3_url, "--dry-run"], ["doctor", hub_url, s3_url]]
    runs = _run_all([["--debug", *c] for c in cmds], env, tmp_path)
    assert not (leaks := _leaks(plants, runs)), "\n".join(leaks)
    for args, r in runs:
        assert r.code == 0, (args, r.err[-2000:])
    assert "X-Xet" in runs[0][1].err  # the Hub demo's log has the Xet token headers (redacted)


def test_the_emulator_banner_shows_no_token(plants: Plants, cli_env: dict[str, str], tmp_path: Path) -> None:
    secret = plants.config_tokens["cli-url-pw"]
    proc = start_cli("--debug", "emulator", "serve", "--data-dir", str(tmp_path / "hub"), "--token",
                     f"me={secret}:write", env={**cli_env, "COLUMNS": "200"})
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while len(lines) < 50 and not (lines and lines[-1].startswith("data dir:")):
            lines.append(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(30)
    assert any(ln.startswith("HF_ENDPOINT=http://127.0.0.1:") for ln in lines), lines
    assert "tokens: me (write)" in lines[-1], lines
    assert not any(secret in ln for ln in lines), lines


# ---- item 1: the keyring in doctor; item 2: a password in HF_ENDPOINT ----------------------------


def test_doctor_never_prints_the_keyring(plants: Plants, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "KVBUCKET_KEYRING": json.dumps(plants.keyring),
           "KVBUCKET_ENCRYPTION_KEY": plants.keyring_keys[1]}
    for args in (["doctor"], ["--debug", "doctor"]):
        r = run_cli(*args, env=env)
        assert plants.found_in(r.out + r.err) == [], r.out
        rows = [ln.split() for ln in r.out.splitlines()]
        assert ["KVBUCKET_KEYRING", "set", "(redacted)"] in rows
        assert ["KVBUCKET_ENCRYPTION_KEY", "set", "(redacted)"] in rows


def test_doctor_with_a_password_in_hf_endpoint(plants: Plants, hub_bucket: Any, cli_env: dict[str, str],
                                               tmp_path: Path) -> None:
    hub = hub_bucket.hub
    endpoint = _with_userinfo(hub.endpoint, "someone", plants.hf_pw)
    env = {**cli_env, "HF_ENDPOINT": endpoint, "HF_TOKEN": hub.write_token, "HF_HOME": str(tmp_path / "hf")}
    url = f"hf://buckets/{hub_bucket.bucket_id}"
    for args in (["doctor", url], ["--debug", "doctor", url]):
        r = run_cli(*args, env=env)
        assert plants.found_in(r.out + r.err) == [], r.out + r.err
        shown = hub.endpoint.replace("://", "://***@")
        # reachable (the emulator answers): not the false "Name or service not known" of a URL with userinfo
        line = next((ln for ln in r.out.splitlines() if f"ok    $HF_ENDPOINT {shown}: " in ln), "")
        assert "answered HTTP" in line, r.out
        assert "Name or service not known" not in r.out
    assert f"GET {shown}/api/buckets/" in r.err  # httpx logged the request, with the userinfo redacted


# ---- item 3 and the other config paths: errors and DEBUG logs --------------------------------------


def _config_errors(p: Plants) -> dict[str, Any]:
    """Each config path with tokens under misspelt keys: name -> a callable raising its error."""
    from kvbucket.config import EngineConfig, load_engine_config
    from kvbucket.encryption import Keyring
    from kvbucket.integrations.lmcache import connector_config_from_extra
    from kvbucket.integrations.sglang import SGLangStorageSettings
    from kvbucket.integrations.vllm import VLLMTierSettings
    from kvbucket.l2.registry import parse_l2_config

    t = p.config_tokens
    return {
        "engine yaml": lambda: load_engine_config(p.engine_yaml),
        "broken engine yaml": lambda: load_engine_config(p.broken_yaml),
        "engine dict, wrong type under a secret key": lambda: EngineConfig.from_dict(
            {"remote_url": f"http://u:{t['yaml-url-pw']}@h/x", "max_local_cpu_size": t["yaml-token"]}),
        "l2 json, misspelt keys": lambda: parse_l2_config(json.dumps(
            {"type": "hfbucket", "bucket_handle": "hf://buckets/a/b", "tokn": t["l2-token"],
             "aws_secret_acces_key": t["l2-aws"], "eviction": {"token": t["l2-nested"]}})),
        "l2 json, wrong type under a secret key": lambda: parse_l2_config(
            {"type": "s3", "s3_endpoint": "s3://b", "aws_secret_access_key": [t["l2-aws"]]}),
        "l2 json, keyring inline": lambda: parse_l2_config(
            {"type": "fs", "base_path": "/tmp/x", "encryption": p.keyring}),
        "connector extra_config": lambda: connector_config_from_extra(
            {"remote_storage_plugin.hfbucket.x.bucket_handle": "hf://buckets/a/b",
             "remote_storage_plugin.hfbucket.x.hf_tokn": t["l2-token"]}, "hfbucket.x"),
        "sglang, top-level token": lambda: SGLangStorageSettings.from_extra_config(
            {"store_url": "hf://buckets/a/b", "token": t["sglang-token"],
             "aws_secret_access_key": t["sglang-aws"]}),
        "sglang, nested": lambda: SGLangStorageSettings.from_extra_config(
            {"store_url": "hf://buckets/a/b", "fleet": {"tokn": t["sglang-fleet"]},
             "known_pages": t["sglang-token"]}),
        "vllm, top-level token": lambda: VLLMTierSettings.from_tier_config(
            {"store_url": "s3://b/p", "token": t["vllm-token"], "aws_secret_access_key": t["vllm-aws"]}),
        "vllm, wrong types": lambda: VLLMTierSettings.from_tier_config(
            {"store_url": "s3://b/p", "store_options": t["vllm-options"], "lookup": t["vllm-token"]}),
        "keyring file": lambda: Keyring.from_file(p.keyring_file),
        "keyring setting": lambda: Keyring.from_setting({"keyring": p.keyring}),
    }


def test_no_config_error_repeats_a_secret(plants: Plants, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for name, raise_it in _config_errors(plants).items():
        with pytest.raises(ConfigError) as info:
            raise_it()
        text = f"{info.value}\n{info.value!r}\n{info.value.args}"
        assert plants.found_in(text) == [], f"{name}: {text}"
        logging.getLogger("kvbucket.test").exception("config failed: %s", info.value)
    assert plants.found_in(caplog.text) == []


def test_settings_errors_name_the_key_and_a_fix(plants: Plants) -> None:
    from kvbucket.integrations.sglang import SGLangStorageSettings
    from kvbucket.integrations.vllm import VLLMTierSettings

    with pytest.raises(ConfigError) as e1:
        SGLangStorageSettings.from_extra_config({"store_url": "x", "prefx": "a", "token": "tok-value-1234"})
    msg = str(e1.value)
    assert "'prefx'" in msg and "did you mean 'prefix'" in msg and "'token'" in msg
    assert "tok-value-1234" not in msg
    with pytest.raises(ConfigError) as e2:
        VLLMTierSettings.from_tier_config({"store_url": "x", "load_thread": 2, "lookup": "tok-value-1234"})
    msg = str(e2.value)
    assert "did you mean 'load_threads'" in msg and "'lookup'" in msg and "tok-value-1234" not in msg


# ---- the one redaction function -----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("token", True), ("hf_tokn", False), ("accessToken", True),
    ("aws_secret_acess_key", True),
    ("AWS_ACCESS_KEY_ID", True), ("KVBUCKET_KEYRING", True), ("keyring", True), ("password", True),
    ("db_passwd", True), ("Authorization", True), ("credentials", True), ("api_key", True), ("apiKey", True),
    ("token_env", False), ("keyring_file", False), ("chunk_tokens", False), ("prompt_tokens", False),
    ("store_url", False), ("HF_ENDPOINT", False), ("max_keys", False), ("encryption", False),
])
def test_looks_secret(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_redact_masks_values_text_and_urls() -> None:
    key = _key()
    assert redact({"token": "abc", "ok": 1, "nested": [{"Password": "pw"}], "token_env": "HF_TOKEN"}) == {
        "token": "***", "ok": 1, "nested": [{"Password": "***"}], "token_env": "HF_TOKEN"}
    assert redact(f"keyring {key} in text") == "keyring *** in text"
    assert redact("GET http://user:pw1234@host:80/x") == "GET http://***@host:80/x"
    assert redact("{'aws_secret_access_key': 'wJalr/K7MDENG', 'region': 'us'}") == (
        "{'aws_secret_access_key': '***', 'region': 'us'}")
    assert redact('"keyring": {"tenants": {"a": {"1": "zz"}}}, "n": 2') == '"keyring": ***, "n": 2'
    assert redact("opaque-1234 here", "opaque-1234") == "*** here"
    harmless = "stored 12 chunks (num_token: 256, chunk_tokens=4, token_source=env, max_keys=3) http://h:1/p"
    assert redact(harmless) == harmless


def test_secrets_in_env_finds_keyring_keys_and_url_passwords() -> None:
    key = _key()
    env = {"KVBUCKET_KEYRING": json.dumps({"tenants": {"t": {"1": key}}}),
           "HF_ENDPOINT": "http://u:longpass1@h",
           "KVBUCKET_EXTRA_CONFIG": json.dumps({"aws_secret_access_key": "extra-secret-1",
                                                "x": "visible-value"}),
           "PATH": "/usr/bin:/bin", "HF_TOKEN": "short"}
    found = secrets_in_env(env)
    assert key in found and "longpass1" in found and "extra-secret-1" in found
    assert "visible-value" not in found and "/usr/bin:/bin" not in found and "short" not in found
