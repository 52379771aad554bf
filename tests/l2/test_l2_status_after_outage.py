"""report_status() after an outage of a real S3 server (SeaweedFS behind a fault proxy).

Issue 40: right after a lookup hit that followed an outage, report_status() showed
``is_healthy: true`` next to the outage's ``last_error`` until a load probed the store. The hit
is answered from the index, and its read-ahead GET is the first request after the outage; what a
status says must agree with itself either way. A failed store's error clears only on a store that
succeeds (F1: a read answering says nothing about whether writes work)."""

from __future__ import annotations

import time
from typing import Any

from kvbucket.keys import ObjectKey
from kvbucket.l2 import open_l2_adapter
from kvbucket.testing import l2 as t
from kvbucket.testing.s3_server import FaultProxy, S3Server

CHUNK = 64 * 1024


def k(i: int) -> ObjectKey:
    return ObjectKey("meta-llama/Llama-3.1-8B", 0x01000100, i.to_bytes(16, "big"), "")


def chunk(i: int) -> bytes:
    return bytes([i % 256]) * CHUNK


def _consistent(status: dict[str, Any]) -> None:
    assert not (status["is_healthy"] and status["last_error"]), (
        f"healthy next to a current error: {status['last_error']!r}"
    )


def _spec(seaweedfs: S3Server, bucket: str, proxy: FaultProxy) -> dict[str, Any]:
    return {"type": "s3", **seaweedfs.config(bucket, prefix="kv", s3_endpoint_url=proxy.url),
            "disable_tls": True, "num_workers": 1, "s3_max_retries": 0,
            "s3_breaker_failures": 2, "s3_breaker_cooldown_secs": 0.5, "full_chunk_bytes": CHUNK}


def test_status_after_an_outage_agrees_with_itself_from_the_first_answer(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    with open_l2_adapter(_spec(seaweedfs, s3_bucket, fault_proxy)) as a:
        assert a.wait_until_rebuilt(30)
        assert t.store(a, [k(1)], [chunk(1)]).success
        fault_proxy.fail(503, "SlowDown", times=1000)  # the outage: every request
        for i in range(2, 5):
            assert not t.store(a, [k(i)], [chunk(i)]).success
        down = a.report_status()
        assert "SlowDown" in (down["last_error"] or ""), down["last_error"]  # a failed put is an error
        assert not down["is_healthy"]
        _consistent(down)
        fault_proxy.clear()  # the store answers again
        time.sleep(0.6)  # past the breaker's cooldown
        before = fault_proxy.requests
        assert t.lookup(a, [k(1)]) == [True]  # from the index; its read-ahead GET is the probe
        deadline = time.monotonic() + 10
        while fault_proxy.requests == before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the read-ahead's answer lands
        assert fault_proxy.requests > before, "the hit started no read-ahead GET"
        read = a.report_status()  # the store answered that GET, but no store has worked since
        _consistent(read)
        assert not read["is_healthy"] and "SlowDown" in (read["last_error"] or ""), read
        assert t.store(a, [k(5)], [chunk(5)]).success  # a store answers: the outage is past
        up = a.report_status()
        _consistent(up)
        assert up["is_healthy"] and up["last_error"] is None, up
        assert "SlowDown" in (up["previous_error"] or ""), up["previous_error"]
        assert up["last_error_at"] == down["last_error_at"]
        a.submit_unlock([k(1)])
