"""Issue 40 item 6: ``--timeout N`` bounds the whole command, every request in it included, not
only the first answer: against an S3 endpoint (SeaweedFS behind the fault proxy) whose listing
answers but whose GETs hang or trickle their bodies, the installed console script ends within N s
(plus start-up slack) with one actionable line."""

from __future__ import annotations

import time
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

from kvbucket.testing.s3_server import FaultProxy, S3Server

N = 3.0
SLACK = 1.0  # the watchdog fires 0.05 s after N; the rest is the process's exit on a shared machine


@pytest.fixture
def proxied(seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy,
            cli_env: dict[str, str]) -> tuple[str, dict[str, str]]:
    c = seaweedfs.client()
    for i in range(4):
        c.put_object(Bucket=s3_bucket, Key=f"kv/obj-{i}", Body=bytes(range(256)) * 16)
    c.put_object(Bucket=s3_bucket, Key="kv/_fleet/d", Body=b"x" * 64)
    env = {**cli_env, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url}
    return f"s3://{s3_bucket}/kv", env


def timed(*args: str, env: dict[str, str]) -> tuple[Any, float]:
    t0 = time.monotonic()
    r = run_cli(*args, env=env, timeout=120)
    return r, time.monotonic() - t0


def test_du_with_a_hung_fleet_status_get_ends_within_the_timeout(proxied: tuple[str, dict[str, str]],
                                                                 fault_proxy: FaultProxy) -> None:
    """du's GET of _fleet/d ran outside --timeout, bounded only by the 60 s request timeout (60.8 s)."""
    url, env = proxied
    fault_proxy.fail(503, "SlowDown", times=1000, methods={"GET"}, delay=100.0, path_contains="_fleet")
    r, took = timed("du", url, "--timeout", str(N), env=env)
    line = assert_one_line_error(r, 1, "within 3 s", "--timeout", fault_proxy.url)
    assert "bounds the whole command" in line
    assert took < N + SLACK, took


def test_verify_with_trickled_bodies_ends_within_the_timeout(proxied: tuple[str, dict[str, str]],
                                                             fault_proxy: FaultProxy) -> None:
    """verify's GETs whose bodies trickle took 5.9-6.9 s with --timeout 3."""
    url, env = proxied
    fault_proxy.trickle(0.05, times=1000, methods={"GET"}, path_contains="obj-")
    r, took = timed("verify", url, "--timeout", str(N), env=env)
    assert_one_line_error(r, 1, "within 3 s", "--timeout", fault_proxy.url)
    assert took < N + SLACK, took
    r, took = timed("verify", url, env={**env, "KVBUCKET_TIMEOUT": str(N)})  # from the environment too
    assert_one_line_error(r, 1, "within 3 s")
    assert took < N + SLACK, took

