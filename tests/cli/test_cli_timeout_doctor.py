"""``kvbucket doctor --timeout N`` bounds the whole command (issue 40, outside check).

Each check had N seconds of its own, one after another (and urllib's timeout is per socket read,
which a server trickling its answer never trips): with a trickling $HF_ENDPOINT, a silent
$AWS_ENDPOINT_URL and two store URLs, ``doctor --timeout 3`` took 44.7 s. The installed console
script now ends within N s (plus start-up slack) and still prints its whole report."""

from __future__ import annotations

import time
from pathlib import Path

from cli_run import assert_one_line_error, run_cli

from kvbucket.testing.s3_server import FaultProxy, S3Server
from kvbucket.testing.silent_server import SilentServer

N = 3.0
SLACK = 1.5  # the process's exit on a shared machine


def test_doctor_with_slow_and_silent_endpoints_ends_within_its_timeout(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    with SilentServer(trickle_secs=0.3) as trickling, SilentServer() as silent:
        env = {**cli_env, "HF_ENDPOINT": trickling.url, "AWS_ENDPOINT_URL": silent.url,
               "HF_TOKEN": "hf_" + "x" * 34, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
               "HF_HOME": str(tmp_path / "hf")}
        t0 = time.monotonic()
        r = run_cli("doctor", "hf://buckets/alice/kv", "s3://bucket/kv", "--timeout", str(N), env=env)
        took = time.monotonic() - t0
    assert r.code == 1 and "Traceback" not in r.err, (r.out, r.err)
    assert took < N + SLACK, f"doctor --timeout {N:g} took {took:.1f} s"
    fails = [ln for ln in r.out.splitlines() if ln.startswith("  FAIL  ")]
    assert [f.split()[1] for f in fails] == ["$HF_ENDPOINT", "$AWS_ENDPOINT_URL", "token",
                                             "hf://buckets/alice/kv", "s3://bucket/kv"], r.out
    assert all("within 3 s" in f for f in fails if " token " not in f), "\n".join(fails)
    assert "not checked: $HF_ENDPOINT did not answer" in r.out  # issue 40 F12: a token line, always
    assert "versions:" in r.out and "environment:" in r.out  # the report is printed all the same


def test_doctor_model_measurement_is_inside_a_given_timeout(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, cli_env: dict[str, str]
) -> None:
    """Its listing answers (the check passes), its loads trickle: --timeout, given, ends the
    measurement (4 s: before the 5 s load deadline an engine's store has, which fails it otherwise)."""
    env = {**cli_env, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url}
    fault_proxy.trickle(0.05, times=10_000, methods={"GET"}, path_contains="_kvbucket_doctor")
    t0 = time.monotonic()
    r = run_cli("doctor", f"s3://{s3_bucket}/kv", "--model", "qwen2.5-0.5b", "--timeout", "4", env=env,
                timeout=120)
    took = time.monotonic() - t0
    assert "  ok    s3://" in r.out, r.out  # the check itself answered
    assert_one_line_error(r, 1, "did not finish within 4 s", "--model's measurement", "_kvbucket_doctor/")
    assert took < 4 + SLACK, took


def test_demo_timeout_bounds_the_first_answer_of_its_target(cli_env: dict[str, str], tmp_path: Path) -> None:
    """docs/cli.md: `demo --target URL --timeout N` bounds the store's first answer (the demo's own
    work takes minutes); a trickling endpoint ends it within N s with one line that says so."""
    with SilentServer(trickle_secs=0.3) as trickling:
        env = {**cli_env, "HF_ENDPOINT": trickling.url, "HF_TOKEN": "hf_" + "x" * 34,
               "HF_HOME": str(tmp_path / "hf")}
        t0 = time.monotonic()
        r = run_cli("demo", "--synthetic", "--chunks", "2", "--target", "hf://buckets/alice/kv", "--timeout",
                    str(N), env=env)
        took = time.monotonic() - t0
    assert_one_line_error(r, 1, "no answer from", "within 3 s", "raise --timeout")
    assert took < N + SLACK, took
