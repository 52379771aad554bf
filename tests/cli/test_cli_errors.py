"""Every CLI error a user can reach with a wrong URL, a missing bucket, a wrong token, an
unreachable endpoint or one that never answers: one ``error:`` line naming the fix, exit 2 (fix
the input) or 1 (the store failed or could not be reached), no traceback. Each case runs the
installed console script in a subprocess against real servers (the Hub emulator, SeaweedFS).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cli_run import KVBUCKET, Run, assert_one_line_error, clean_env, cli_environ, run_cli

from kvbucket.testing.s3_server import S3Server, free_port
from kvbucket.testing.silent_server import SilentServer


@pytest.fixture
def hub_env(hub_emulator: Any, cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**cli_env, "HF_ENDPOINT": hub_emulator.endpoint, "HF_TOKEN": hub_emulator.write_token,
            "HF_HOME": str(tmp_path / "hf-home"), "HF_XET_CACHE": str(tmp_path / "xet")}


@pytest.fixture
def s3_env(seaweedfs: S3Server, cli_env: dict[str, str]) -> dict[str, str]:
    return {**cli_env, **seaweedfs.env()}


def missing_bucket(hub_emulator: Any) -> str:
    return f"hf://buckets/{hub_emulator.namespace}/nope-{uuid.uuid4().hex[:8]}"


# ---- wrong URL: exit 2 ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "needle"), [
    (["ls", "nosuch://x"], "unknown store URL scheme"),
    (["du", "hf://buckets/only-namespace"], "names no bucket"),
    (["rm", "ftp://host/x", "a"], "unknown store URL scheme"),
    (["demo", "--synthetic", "--target", "redis://x", "--chunks", "1"], "unknown store URL scheme"),
    (["demo", "--target", "ftp://x"], "unknown store URL scheme"),  # the real-model demo too, at once
    (["demo", "--latency-ms", "50", "--target", "/tmp"], "--latency-ms"),
    (["demo", "--synthetic", "--latency-ms", "50"], "real-model demo"),
    (["compile-cache", "fetch", "--target", "ftp://example.com/x"], "hf://buckets/<namespace>/<bucket>"),
    (["compile-cache", "set", "hf://buckets/only-namespace"], "does not name a bucket"),
    (["stats", "--url", "ftp://x"], "not an http(s) URL"),
    (["ls"], "missing argument"),
    (["ls", "/tmp", "--no-such-option"], "no such option"),
])
def test_wrong_url_or_usage_is_one_line_exit_2(args: list[str], needle: str, cli_env: dict[str, str]) -> None:
    r = run_cli(*args, env=cli_env)
    assert_one_line_error(r, 2, needle)


# ---- missing bucket: exit 2, says how to create it ----------------------------------------------


@pytest.mark.parametrize("cmd", [
    ["ls"], ["du"], ["rm", "--prefix", "x/", "--yes"], ["demo", "--synthetic", "--chunks", "2", "--target"],
    ["compile-cache", "fetch", "--layout", "torch", "--target"],
])
def test_missing_hub_bucket(cmd: list[str], hub_emulator: Any, hub_env: dict[str, str]) -> None:
    url = missing_bucket(hub_emulator)
    r = run_cli(*cmd, url, env=hub_env)
    bucket_id = url.removeprefix("hf://buckets/")
    line = assert_one_line_error(r, 2, "not found", f"hf buckets create {bucket_id} --private")
    assert bucket_id in line
    assert r.out.count("does not exist") == 0  # the demo stops before its first chunk, no table


def test_missing_s3_bucket(s3_env: dict[str, str]) -> None:
    for cmd in (["ls"], ["demo", "--synthetic", "--chunks", "2", "--target"]):
        r = run_cli(*cmd, "s3://no-such-bucket-cli-16/x", env=s3_env)
        assert_one_line_error(r, 2, "does not exist")


# ---- wrong token: exit 2, names where the token came from, never prints it -------------------------


def test_wrong_hub_token(hub_emulator: Any, hub_bucket: Any, hub_env: dict[str, str]) -> None:
    bad = "hf_wrong_cli_token_0123456789"
    env = {**hub_env, "HF_TOKEN": bad}
    url = f"hf://buckets/{hub_bucket.bucket_id}"
    for cmd in (["ls", url], ["compile-cache", "create", f"{url}-new", "--no-set"]):
        r = run_cli(*cmd, env=env)
        line = assert_one_line_error(r, 2, "$HF_TOKEN")
        assert bad not in r.out + r.err, line


def test_a_refused_token_on_a_public_bucket_reads_as_invalid(hub_emulator: Any,
                                                             hub_env: dict[str, str]) -> None:
    """Issue 40 item 2: a wrong token on a bucket anyone may read is answered HTTP 401; `hf` says the
    token is invalid, so kvbucket says invalid or expired, not that it "needs access" (a permission)."""
    bucket = f"{hub_emulator.namespace}/pub-{uuid.uuid4().hex[:8]}"
    hub_emulator.api().create_bucket(bucket, private=False)
    env = {**hub_env, "HF_TOKEN": "hf_wrong_public_token_0123456789"}
    r = run_cli("ls", bucket, env=env)
    line = assert_one_line_error(r, 2, "$HF_TOKEN", "HTTP 401", "invalid or expired")
    assert "needs access" not in line and "hf_wrong_public_token" not in line


def test_no_hub_token_says_there_is_none(hub_emulator: Any, hub_env: dict[str, str]) -> None:
    env = {**hub_env, "HF_TOKEN": ""}
    r = run_cli("compile-cache", "create", missing_bucket(hub_emulator), "--no-set", env=env)
    assert_one_line_error(r, 2, "no token found", "set HF_TOKEN or run `hf auth login`")


@pytest.mark.parametrize("cmd", [["ls"], ["du"], ["rm", "--prefix", "x/", "--yes"]])
def test_no_token_and_a_private_bucket_asks_for_a_token(cmd: list[str], hub_bucket: Any,
                                                         hub_env: dict[str, str]) -> None:
    """Issue 31 item 7: the Hub answers 401 to an anonymous caller for a private bucket (as for a
    missing one); the fix is a token, worded as `hf` words it, not a config key."""
    r = run_cli(*cmd, f"hf://buckets/{hub_bucket.bucket_id}", env={**hub_env, "HF_TOKEN": ""})
    line = assert_one_line_error(r, 2, "no token found", "set HF_TOKEN or run `hf auth login`")
    assert "create_bucket_if_missing" not in line


def test_rm_with_a_read_only_token_is_one_line_exit_2(hub_emulator: Any, hub_bucket: Any,
                                                      hub_env: dict[str, str]) -> None:
    """Issue 31 item 9: a refused token stops `rm` with one line and exit 2 (docs/cli.md), not a
    line per object; the line says what the token lacks, not "commit a batch of writes"."""
    from kvbucket.stores import open_store

    url = f"hf://buckets/{hub_bucket.bucket_id}"
    with open_store(url, token=hub_emulator.write_token, endpoint=hub_emulator.endpoint) as store:
        assert all(r.ok for r in store.put_many([(f"p/{i}", b"x" * 10) for i in range(5)]))
    r = run_cli("rm", url, "--prefix", "p/", "-y", env={**hub_env, "HF_TOKEN": hub_emulator.read_token})
    said, *errors = r.err_lines  # every rm says first where it removes from (issue 39)
    assert said.startswith(f"removing from the Hub bucket {hub_bucket.bucket_id} at "), r.err
    line = assert_one_line_error(Run(r.code, r.out, "\n".join(errors)), 2, "remove objects", "write access",
                                 "$HF_TOKEN")
    assert "commit a batch" not in line
    assert hub_emulator.read_token not in r.out + r.err
    with open_store(url, token=hub_emulator.write_token, endpoint=hub_emulator.endpoint) as store:
        assert len(list(store.list("p/"))) == 5  # nothing was removed


def test_wrong_s3_secret(seaweedfs: S3Server, s3_bucket: str, s3_env: dict[str, str]) -> None:
    env = {**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong-secret-value-16"}
    r = run_cli("ls", f"s3://{s3_bucket}", env=env)
    assert_one_line_error(r, 2, "refused")
    assert "wrong-secret-value-16" not in r.out + r.err


# ---- unreachable endpoint (closed port): exit 1, names the endpoint to check ------------------------


def test_unreachable_hub(cli_env: dict[str, str], tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {**cli_env, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_x", "HF_HOME": str(tmp_path / "hf")}
    r = run_cli("ls", "hf://buckets/a/b", env=env, timeout=180)
    assert_one_line_error(r, 1, endpoint, "$HF_ENDPOINT", "reachable")


def test_unreachable_s3(s3_env: dict[str, str]) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    r = run_cli("du", "s3://bucket/x", env={**s3_env, "AWS_ENDPOINT_URL": endpoint}, timeout=180)
    assert_one_line_error(r, 1, endpoint, "$AWS_ENDPOINT_URL", "reachable")


def test_unreachable_metrics_endpoint(cli_env: dict[str, str]) -> None:
    r = run_cli("stats", "--url", f"http://127.0.0.1:{free_port()}/metrics", env=cli_env)
    assert_one_line_error(r, 1, "cannot reach", "start_metrics_server")


# ---- an endpoint that accepts and never answers: exit 1 within --timeout ----------------------------


SILENT_CMDS = [
    ["ls", "hf://buckets/a/b"],
    ["demo", "--synthetic", "--chunks", "1", "--target", "hf://buckets/a/b"],
    ["compile-cache", "create", "hf://buckets/a/b", "--no-set"],
    ["compile-cache", "fetch", "--layout", "torch", "--target", "hf://buckets/a/b"],
    ["du", "s3://bucket/x"],
    ["rm", "hf://buckets/a/b", "x"],
    ["compile-cache", "sync", "--layout", "torch", "--target", "hf://buckets/a/b"],
    ["compile-cache", "lookup", "org/model", "--layout", "torch", "--target", "s3://bucket/x"],
    ["verify", "hf://buckets/a/b"],
]
SilentRuns = dict[str, tuple[Run, float]]  # command line -> (its run, its seconds)


@pytest.fixture(scope="module")
def silent_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SilentRuns]]:
    """Every command of SILENT_CMDS, ``--timeout 2``, against one endpoint that never answers:
    (endpoint, {command: (run, seconds)}). Three run at once (each mostly waits its 2 s), not one
    after another; each command has its own config dir and HF_HOME, and its own test below."""
    with SilentServer() as srv:
        endpoint = f"http://127.0.0.1:{srv.port}"

        def timed(cmd: list[str]) -> tuple[Run, float]:
            home = tmp_path_factory.mktemp("silent")
            env = {**clean_env(home / "kvbucket-config"), "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_x",
                   "HF_HOME": str(home / "hf"), "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "a",
                   "AWS_SECRET_ACCESS_KEY": "b", "AWS_REGION": "us-east-1"}
            t0 = time.monotonic()
            r = run_cli(*cmd, "--timeout", "2", env=env, timeout=120)
            return r, time.monotonic() - t0

        with ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(timed, SILENT_CMDS))
        yield endpoint, {" ".join(c): r for c, r in zip(SILENT_CMDS, runs, strict=True)}


@pytest.mark.parametrize("cmd", SILENT_CMDS)
def test_silent_endpoint_fails_within_the_timeout(
        cmd: list[str], silent_runs: tuple[str, SilentRuns]) -> None:
    endpoint, runs = silent_runs
    r, elapsed = runs[" ".join(cmd)]
    assert_one_line_error(r, 1, "no answer", endpoint, "within 2 s", "--timeout")
    assert elapsed < 60  # bounded: 2 s of waiting plus interpreter start-up, far from the 60 s limit


@pytest.mark.parametrize("url", ["hf://buckets/a/b", "s3://bucket/x"])
def test_timeout_bounds_the_whole_command(url: str, silent_port: int, cli_env: dict[str, str],
                                          tmp_path: Path) -> None:
    """Issue 31 item 8: `--timeout N` on an endpoint that never answers ends within N + 10%, counted
    as the user counts it (from the command's start: interpreter start-up and imports are inside
    the budget, which counts from the process's start)."""
    endpoint = f"http://127.0.0.1:{silent_port}"
    env = {**cli_env, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_x", "HF_HOME": str(tmp_path / "hf"),
           "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
           "AWS_REGION": "us-east-1"}
    t0 = time.monotonic()
    r = run_cli("ls", url, "--timeout", "5", env=env, timeout=120)
    elapsed = time.monotonic() - t0
    assert_one_line_error(r, 1, "no answer", "within 5 s")
    assert elapsed <= 5 * 1.1, elapsed


def test_stats_on_a_silent_endpoint_ends_within_its_timeout(silent_port: int,
                                                            cli_env: dict[str, str]) -> None:
    """``kvbucket stats`` on an endpoint that accepts the connection and never answers: one line
    naming the endpoint and what to check, exit 1, within ``--timeout`` (counted from the command's
    start, as the other commands count it) and, without it, within the documented 10 s."""
    url = f"http://127.0.0.1:{silent_port}/metrics"
    for args, secs in ((["--timeout", "4"], 4), ([], 10)):
        t0 = time.monotonic()
        r = run_cli("stats", "--url", url, *args, env=cli_env, timeout=60)
        elapsed = time.monotonic() - t0
        assert_one_line_error(r, 1, f"no answer from {url} within {secs} s", "--url", "--timeout")
        assert elapsed <= secs * 1.1, (args, elapsed)


@pytest.mark.parametrize("url", ["hf://buckets/a/b", "s3://bucket/x"])
def test_connection_refused_is_not_retried(url: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Issue 31 item 8: nothing listens on the port: the first refusal is the error (on main the Hub
    client retried 5 times, 0.5 + 1 + 2 + 4 + 8 s, and printed the line after 16.6 s)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {**cli_env, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_x", "HF_HOME": str(tmp_path / "hf"),
           "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
           "AWS_REGION": "us-east-1"}
    t0 = time.monotonic()
    r = run_cli("ls", url, env=env, timeout=120)
    elapsed = time.monotonic() - t0
    assert_one_line_error(r, 1, endpoint, "reachable")
    assert elapsed < 10, elapsed  # no backoff: well under the 15.5 s of sleeps five retries take
    if url.startswith("hf://"):
        assert "connection refused" in r.err
        debug = run_cli("--debug", "ls", url, env=env, timeout=120)
        assert debug.code == 1 and "retrying list the bucket" not in debug.err, debug.err[-2000:]


def test_timeout_also_comes_from_the_environment(silent_port: int, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "HF_ENDPOINT": f"http://127.0.0.1:{silent_port}", "HF_TOKEN": "hf_x",
           "KVBUCKET_TIMEOUT": "1.5"}
    r = run_cli("ls", "hf://buckets/a/b", env=env, timeout=120)
    assert_one_line_error(r, 1, "within 1.5 s")


# ---- emulator serve: a taken port, a file as --data-dir --------------------------------------------


def test_emulator_serve_on_a_taken_port(tmp_path: Path, cli_env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_cli("emulator", "serve", "--data-dir", str(tmp_path / "hub"), "--port", str(port),
                    env=cli_env, timeout=60)
    assert_one_line_error(r, 1, "taken", "--port")


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_emulator_serve_with_a_port_out_of_range(port: str, tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Issue 31 item 11: a usage error naming --port, not "unexpected OverflowError (a kvbucket bug)"."""
    r = run_cli("emulator", "serve", "--data-dir", str(tmp_path / "hub"), "--port", port, env=cli_env,
                timeout=60)
    line = assert_one_line_error(r, 2, "--port")
    assert "bug" not in line


def test_emulator_serve_on_an_address_not_of_this_machine(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Issue 31 item 11: binding 192.0.2.1 (TEST-NET-1, on no interface here) fails at once with
    EADDRNOTAVAIL, nothing sent; the line names --host, not "pick another --port"."""
    r = run_cli("emulator", "serve", "--data-dir", str(tmp_path / "hub"), "--host", "192.0.2.1",
                env=cli_env, timeout=60)
    line = assert_one_line_error(r, 2, "192.0.2.1 is not an address of this machine", "--host")
    assert "--port" not in line


@pytest.mark.parametrize("endpoint", ["localhost:1234", "http://[::1", "http://127.0.0.1:99999", "ftp://host"])
def test_a_malformed_hf_endpoint_exits_2(endpoint: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Issue 31 item 11: docs/cli.md says 2 for a malformed URL or environment; one line, before
    huggingface_hub's import prints its own error."""
    env = {**cli_env, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_x", "HF_HOME": str(tmp_path / "hf")}
    for cmd in (["ls", "hf://buckets/a/b"], ["compile-cache", "create", "hf://buckets/a/b", "--no-set"]):
        r = run_cli(*cmd, env=env, timeout=120)
        assert_one_line_error(r, 2, "$HF_ENDPOINT", "is not an http(s) URL", "https://huggingface.co")


def test_emulator_serve_with_a_file_as_data_dir(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Refused at once (20 s bounds each run on a loaded machine), before the emulator is imported,
    naming the file and what to give instead; a path under a file names that file."""
    f = tmp_path / "a-file"
    f.write_text("x")
    r = run_cli("emulator", "serve", "--data-dir", str(f), env=cli_env, timeout=20)
    assert_one_line_error(r, 2, f"{f} is a file;", "give a directory", "--data-dir")
    r = run_cli("emulator", "serve", "--data-dir", str(f / "sub"), env=cli_env, timeout=20)
    assert_one_line_error(r, 2, f"{f} is a file, so {f / 'sub'} cannot be a directory", "give a directory")
    p = subprocess.run([sys.executable, "-X", "importtime", str(KVBUCKET), "emulator", "serve", "--data-dir",
                        str(f)], capture_output=True, text=True, timeout=20, env=cli_environ(cli_env))
    assert p.returncode == 2 and "is a file" in p.stderr, p.stderr[-2000:]
    assert "kvbucket.testing.hub_emulator" not in p.stderr and "aiohttp" not in p.stderr


# ---- compile-cache: set refuses what cannot be a target; create prints a human line -----------------


def test_compile_cache_set_refuses_a_missing_directory(tmp_path: Path, cli_env: dict[str, str]) -> None:
    r = run_cli("compile-cache", "set", str(tmp_path / "nonexistent" / "dir"), env=cli_env)
    assert_one_line_error(r, 2, "does not exist", "compile-cache create")
    assert not (tmp_path / "kvbucket-config" / "compile_cache.json").exists()


def test_compile_cache_create_prints_a_human_line(hub_emulator: Any, hub_env: dict[str, str]) -> None:
    url = missing_bucket(hub_emulator)
    r = run_cli("compile-cache", "create", url, "--no-set", env=hub_env)
    assert r.code == 0, r.err
    assert "BucketUrl" not in r.out and "(" in r.out
    first = r.out.splitlines()[0]
    bucket_id = url.removeprefix("hf://buckets/")
    assert first == f"bucket {bucket_id} ready (private) on {hub_emulator.endpoint}: {url}"


# ---- tracebacks only on request ---------------------------------------------------------------------

_BUGGY = """
import sys
import kvbucket.cli as cli
app = cli.build_app()

@app.command("boom")
def boom() -> None:
    raise RuntimeError("something unexpected")

cli.main(sys.argv[1:])
"""


def test_an_unexpected_error_is_one_line_unless_debug(cli_env: dict[str, str]) -> None:
    import os
    import subprocess

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _BUGGY, *args], capture_output=True, text=True,
                              env={**os.environ, **cli_env, **extra}, timeout=60)

    p = run("boom")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: unexpected RuntimeError: something unexpected (a kvbucket bug: rerun with --debug and "
        "report the traceback)"
    ]
    for p in (run("--debug", "boom"), run("boom", KVBUCKET_LOG_LEVEL="DEBUG")):
        assert p.returncode == 1 and "Traceback" in p.stderr
        assert "RuntimeError: something unexpected" in p.stderr
