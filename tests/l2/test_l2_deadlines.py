"""The L2 adapter over a hung store: ``lookup_and_lock`` answers "miss" within 2 s with default
settings (it took 376 s on an hfbucket endpoint that never answers), loads fail at their
deadline, and with the store's breaker open lookups answer at once (docs/reliability.md)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from kvbucket.keys import ObjectKey
from kvbucket.l2 import open_l2_adapter
from kvbucket.stores.guard.breaker import OPEN
from kvbucket.testing import l2 as t
from kvbucket.testing.silent_server import SilentServer

CHUNK = 4096


def k(i: int) -> ObjectKey:
    return ObjectKey("Qwen/Qwen3-8B", 0x01000100, i.to_bytes(16, "big"), "")


def spec(kind: str, url: str, **extra: Any) -> dict[str, Any]:
    """Default deadlines, except one HTTP request (the usage rebuild's listing, which ``close``
    waits for) ends after 2 s instead of 30/60 s, to keep the test short."""
    if kind == "hfbucket":
        return {"type": "hfbucket", "bucket_handle": "hf://buckets/o/b/kv", "token": "hf_x", "token_env": "",
                "endpoint": url, "full_chunk_bytes": CHUNK, "request_timeout_secs": 2, **extra}
    return {"type": "s3", "s3_endpoint": "s3://bucket/kv", "s3_endpoint_url": url, "s3_region": "us-east-1",
            "aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "not-a-secret",
            "full_chunk_bytes": CHUNK, "s3_request_timeout_secs": 2, **extra}


@pytest.mark.parametrize("kind", ["hfbucket", "s3"])
def test_lookup_and_lock_on_a_hung_store_misses_within_2s_with_defaults(kind: str) -> None:
    with SilentServer() as server:
        a = open_l2_adapter(spec(kind, server.url))
        try:
            t0 = time.monotonic()
            assert t.lookup(a, [k(1), k(2)], timeout=60) == [False, False]
            assert time.monotonic() - t0 < 2.0
            buf = bytearray(CHUNK)
            t0 = time.monotonic()
            assert t.load(a, [k(1)], [buf], timeout=60) == [False]
            assert time.monotonic() - t0 < 2.0  # no first answer within the lookup budget (1 s)
        finally:
            a.close()


@pytest.mark.parametrize("kind", ["hfbucket", "s3"])
def test_lookups_with_the_breaker_open_answer_at_once(kind: str) -> None:
    prefix = "" if kind == "hfbucket" else "s3_"
    with SilentServer() as server:
        a = open_l2_adapter(spec(kind, server.url, **{f"{prefix}lookup_timeout_secs": 0.2,
                                                      f"{prefix}breaker_failures": 2,
                                                      f"{prefix}breaker_cooldown_secs": 600}))
        try:
            for i in range(2):
                assert t.lookup(a, [k(10 + i)], timeout=60) == [False]
            assert a._store.breaker.state is OPEN
            # Through LMCache's protocol (submit, wait for the event fd, query): a miss.
            assert t.lookup(a, [k(99)], timeout=60) == [False]
            # The adapter's own lookup path, submit + result: answered in the caller's thread
            # (the result is there when submit returns), without the store or the loop thread.
            times = []
            for i in range(300):
                t0 = time.perf_counter()
                tid = a.submit_lookup_and_lock_task([k(100 + i)])
                got = a.query_lookup_and_lock_result(tid)
                times.append(time.perf_counter() - t0)
                assert got == [False]
            assert statistics.median(times) < 0.001  # the bound with the breaker open: 1 ms
            assert a.report_status()["breaker_misses"] >= 300
        finally:
            a.close()
