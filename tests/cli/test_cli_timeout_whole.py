"""Issue 40 item 6: ``--timeout N`` bounds the whole command, every request in it included, not
only the first answer: against an S3 endpoint (SeaweedFS behind the fault proxy) whose listing
answers but whose GETs hang or trickle their bodies, the installed console script ends within N s
(plus start-up slack) with one actionable line."""

from __future__ import annotations

import json
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


def test_verify_of_a_slow_but_working_s3_passes_within_its_timeout(
        seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, cli_env: dict[str, str]) -> None:
    """Every request 1.5 s late: verify gave up after 1.8 s naming s3_lookup_timeout_secs (the
    inference path's 1 s read deadline) even with --timeout 30; a command's reads get its timeout."""
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import ObjectStoreL2Adapter
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store
    from kvbucket.testing import l2 as t

    store = S3Store(S3Config.parse(seaweedfs.config(s3_bucket, "kv")))
    adapter = ObjectStoreL2Adapter(store, full_chunk_bytes=256)
    try:
        keys = [ObjectKey("org/llama", 0, i.to_bytes(8, "big")) for i in range(3)]
        assert t.store(adapter, keys, [bytes([i + 1]) * 256 for i in range(3)]).success
    finally:
        adapter.close()
    fault_proxy.latency = 1.5
    env = {**cli_env, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url}
    r, took = timed("verify", f"s3://{s3_bucket}/kv", "--timeout", "30", "--json", env=env)
    assert r.code == 0, (r.out, r.err, took)
    assert json.loads(r.out)["totals"]["good"]["objects"] == 3, r.out
