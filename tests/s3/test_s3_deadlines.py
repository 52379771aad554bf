"""S3Store against a hung, slow or killed endpoint: every verb answers within its deadline, and the
circuit breaker answers at once while the endpoint is down (docs/reliability.md).

Each test asserts the answer AND an upper bound on the time to it, with wide margins: today's
code took 60-180 s per call (a 60 s request timeout, retried) against a silent endpoint.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import pytest

from kvbucket.errors import CircuitOpenError, DeadlineExceededError, TransientStoreError
from kvbucket.metrics import STORE_BREAKER_STATE
from kvbucket.stores.guard.breaker import CLOSED, OPEN
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import FaultProxy, S3Server, SeaweedFS
from kvbucket.testing.silent_server import SilentServer

MiB = 1024 * 1024


def silent_store(server: SilentServer, **overrides: Any) -> S3Store:
    return S3Store(S3Config.parse({
        "s3_endpoint": "s3://bucket/p", "s3_endpoint_url": server.url, "s3_region": "us-east-1",
        "aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "not-a-secret", **overrides,
    }))


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("direct", [True, False])
def test_lookup_against_a_hung_endpoint_answers_within_2s_with_default_settings(direct: bool) -> None:
    with SilentServer() as server:
        store = silent_store(server, s3_direct_reads=direct)  # otherwise defaults
        results, took = timed(store.head_many, ["a", "b", "c"])
        assert [type(r.error) for r in results] == [DeadlineExceededError] * 3
        assert "s3_lookup_timeout_secs" in str(results[0].error)
        assert took < 2.0  # was 180 s
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 7.0


@pytest.mark.parametrize("direct", [True, False])
def test_load_against_a_hung_endpoint_answers_within_2s_with_default_settings(direct: bool) -> None:
    """A load's first answer is its lookup part: with no response headers within
    s3_lookup_timeout_secs (1 s) the endpoint is hung (was: the 5 s load budget)."""
    with SilentServer() as server:
        store = silent_store(server, s3_direct_reads=direct)
        results, took = timed(store.get_many, ["a", "b"], [bytearray(10), None])
        assert [type(r.error) for r in results] == [DeadlineExceededError] * 2
        assert "s3_lookup_timeout_secs" in str(results[0].error)
        assert took < 2.0
    with SilentServer(trickle_secs=0.02) as server:  # headers trickle past the lookup budget
        store = silent_store(server, s3_direct_reads=direct)
        (r,), took = timed(store.get_many, ["a"])
        assert isinstance(r.error, DeadlineExceededError) and took < 2.0


@pytest.mark.parametrize("direct", [True, False])
def test_a_slow_transfer_that_answered_keeps_the_load_budget(
    direct: bool, seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    """The lookup-sized window is for the first answer only: a body arriving a byte every
    0.03 s after prompt headers (per-read timeouts never trip) loads within the load budget."""
    cfg = seaweedfs.config(s3_bucket, s3_endpoint_url=fault_proxy.url, s3_direct_reads=direct)
    with S3Store(S3Config.parse(cfg)) as store:  # default budgets: lookup 1 s, load 5 s
        body = bytes(range(64))
        assert store.put_many([("slow", body)])[0].ok
        fault_proxy.trickle(0.03, methods={"GET"}, path_contains="slow")
        buf = bytearray(64)
        (r,), took = timed(store.get_many, ["slow"], [buf])
        assert r.ok and bytes(buf) == body
        assert 1.5 < took < 4.5  # past the lookup budget, within the load budget


@pytest.mark.parametrize("direct", [True, False])
def test_load_store_delete_list_against_a_hung_endpoint_end_at_their_deadlines(direct: bool) -> None:
    with SilentServer() as server:
        store = silent_store(server, s3_direct_reads=direct, s3_load_timeout_secs=0.5,
                             s3_store_timeout_secs=0.8, s3_request_timeout_secs=0.8, s3_breaker_failures=0)
        buf = bytearray(10)
        results, took = timed(store.get_many, ["a", "b"], [buf, None])
        assert all(isinstance(r.error, DeadlineExceededError) for r in results) and took < 4.0  # was 120 s
        results, took = timed(store.put_many, [("a", b"x" * 100), ("b", b"y")])
        assert all(isinstance(r.error, DeadlineExceededError) for r in results) and took < 5.0  # was 60 s
        results, took = timed(store.delete_many, ["a"])
        assert isinstance(results[0].error, DeadlineExceededError) and took < 5.0
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError):
            list(store.list())
        assert time.monotonic() - t0 < 5.0
        store.close()


def test_slow_answers_past_the_deadline_are_failures_and_the_store_recovers(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    cfg = seaweedfs.config(s3_bucket, s3_endpoint_url=fault_proxy.url, s3_load_timeout_secs=1.0,
                           s3_lookup_timeout_secs=1.0, s3_breaker_failures=0)
    with S3Store(S3Config.parse(cfg)) as store:
        assert store.put_many([("k", b"value")])[0].ok
        fault_proxy.fail(503, "SlowDown", times=50, methods={"GET", "HEAD"}, delay=3.0)
        buf = bytearray(5)
        (r,), took = timed(store.get_many, ["k"], [buf])
        assert isinstance(r.error, DeadlineExceededError) and took < 2.5
        (r,), took = timed(store.head_many, ["k"])
        assert isinstance(r.error, DeadlineExceededError) and took < 2.5
        fault_proxy.clear()
        (r,) = store.get_many(["k"], [buf])
        assert r.ok and bytes(buf) == b"value"


def test_put_many_returns_when_the_server_is_killed_mid_call_and_stays_down() -> None:
    weed = SeaweedFS()
    server = weed.start()
    try:
        bucket = "killed"
        server.create_bucket(bucket)
        store = S3Store(S3Config.parse(server.config(bucket, s3_store_timeout_secs=3.0,
                                                     s3_load_timeout_secs=2.0, s3_breaker_failures=0)))
        items = [(f"o{i}", i.to_bytes(4, "little") * (MiB // 4)) for i in range(64)]
        killer = threading.Timer(0.3, weed.stop)
        killer.start()
        results, took = timed(store.put_many, items * 4)
        killer.join()
        assert len(results) == 256
        assert all(r.ok or isinstance(r.error, TransientStoreError) for r in results)
        assert not all(r.ok for r in results)
        assert took < 10.0
        (r,), took = timed(store.get_many, ["o1"])
        assert isinstance(r.error, TransientStoreError) and took < 5.0
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 7.0
    finally:
        weed.stop()


def test_breaker_opens_answers_in_under_a_millisecond_then_probes_and_closes(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    cfg = seaweedfs.config(s3_bucket, s3_endpoint_url=fault_proxy.url, s3_lookup_timeout_secs=0.3,
                           s3_breaker_failures=3, s3_breaker_cooldown_secs=2.0)
    with S3Store(S3Config.parse(cfg)) as store:
        assert store.put_many([("k", b"value")])[0].ok
        fault_proxy.fail(503, "SlowDown", times=1000, methods={"HEAD"}, delay=2.0)
        for _ in range(3):
            (r,) = store.head_many(["k"])
            assert isinstance(r.error, DeadlineExceededError)
        assert store.breaker.state is OPEN
        assert STORE_BREAKER_STATE.labels(store.url)._value.get() == 2
        seen = fault_proxy.requests
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            (r,) = store.head_many(["k"])
            times.append(time.perf_counter() - t0)
            assert isinstance(r.error, CircuitOpenError)
        assert statistics.median(times) < 0.001
        assert fault_proxy.requests == seen  # nothing reached the network
        fault_proxy.clear()
        time.sleep(2.1)  # the cooldown: the next call is a probe
        (r,) = store.head_many(["k"])
        assert r.size == 5 and r.error is None
        assert store.breaker.state is CLOSED


def test_a_fresh_stores_first_listing_shares_one_budget_with_its_bucket_probe() -> None:
    """Issue 40 item 6: list() on a fresh store waited the whole request budget for the bucket
    probe, then gave the first page a new one (6.0 s for s3_request_timeout_secs: 3)."""
    with SilentServer() as server:
        store = silent_store(server, s3_request_timeout_secs=2.0, s3_breaker_failures=0)
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError, match="s3_request_timeout_secs"):
            list(store.list())
        took = time.monotonic() - t0
        assert 1.9 < took < 3.0, took  # one budget (2 s), not two (4 s)
        store.close()
