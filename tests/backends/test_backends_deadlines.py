"""RemoteBackend and HybridBackend over a remote store that never answers (HF bucket, S3): each
call ends at the store's deadline (not at the backend's 10 s blocking timeout, and not minutes
later), reads are misses, stores fail without failing the tiers that took them, and with the
store's breaker open every call answers at once (docs/reliability.md)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbucket.backends import HybridBackend, LocalCPUBackend, RemoteBackend
from kvbucket.backends.hybrid import TierPutError
from kvbucket.chunks import KVLayout
from kvbucket.stores import ObjectStore
from kvbucket.stores.guard.breaker import OPEN
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.silent_server import SilentServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", chunk_tokens=16)
FULL = LAYOUT.full_chunk_bytes


def hung_store(kind: str, url: str, **extra: object) -> ObjectStore:
    if kind == "hf":
        return HFBucketStore(build_config(bucket_handle="hf://buckets/o/b", token="hf_x", token_env="",
                                          endpoint=url, **extra))
    return S3Store(S3Config.parse({
        "s3_endpoint": "s3://bucket", "s3_endpoint_url": url, "s3_region": "us-east-1",
        "aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "not-a-secret",
        **{f"s3_{k}": v for k, v in extra.items()},
    }))


@pytest.fixture
def server() -> Iterator[SilentServer]:
    with SilentServer() as s:
        yield s


def elapsed(t0: float) -> float:
    return time.monotonic() - t0


@pytest.mark.parametrize("kind", ["hf", "s3"])
def test_remote_backend_lookups_and_reads_end_at_the_store_deadline(kind: str, server: SilentServer) -> None:
    store = hung_store(kind, server.url)  # default deadlines: lookup 1 s, load 5 s
    b = RemoteBackend(store, LAYOUT)  # default blocking_timeout_secs=10
    try:
        t0 = time.monotonic()
        assert b.batched_contains(["k1", "k2"]) == [False, False]  # a miss, not an exception
        assert elapsed(t0) < 2.0  # lookup_timeout_secs=1 (was 10 s here, 60-376 s in the store)
        t0 = time.monotonic()
        assert b.contains("k3") is False
        assert elapsed(t0) < 2.0
        assert b.lookup_failures == 3
        t0 = time.monotonic()
        assert b.batched_get(["k1"]) == [None]
        assert elapsed(t0) < 2.0  # no first answer within the lookup budget (1 s), HF and S3
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("kind", ["hf", "s3"])
def test_hybrid_backend_keeps_serving_from_its_fast_tier(kind: str, server: SilentServer) -> None:
    store = hung_store(kind, server.url, store_timeout_secs=1.5, load_timeout_secs=1.0, breaker_failures=3,
                       breaker_cooldown_secs=600)
    cpu = LocalCPUBackend(1 << 22)
    h = HybridBackend([cpu, RemoteBackend(store, LAYOUT)])
    try:
        chunk = np.arange(FULL, dtype=np.uint8)
        t0 = time.monotonic()
        (err,) = h.batched_put_results([("k", chunk)])
        assert isinstance(err, TierPutError) and elapsed(t0) < 4.0  # the remote tier's store deadline
        assert cpu.contains("k")
        t0 = time.monotonic()
        got = h.batched_get(["k", "other"])
        assert bytes(got[0]) == chunk.tobytes() and got[1] is None
        assert elapsed(t0) < 2.0  # the lookup budget (1 s)
        for _ in range(3):
            h.batched_get(["missing"])
        assert store.breaker.state is OPEN
        times = []
        for i in range(100):
            t0 = time.perf_counter()
            assert h.batched_get([f"m{i}"]) == [None]
            times.append(time.perf_counter() - t0)
        assert statistics.median(times) < 0.01  # a thread hop in RemoteBackend, no network
        t0 = time.monotonic()
        (err,) = h.batched_put_results([("k2", chunk)])
        assert isinstance(err, TierPutError) and "circuit breaker open" in str(err)  # dropped, counted
        assert elapsed(t0) < 0.5 and cpu.contains("k2")
    finally:
        h.close()
        store.close()


@pytest.mark.parametrize("kind", ["hf", "s3"])
def test_lookups_on_a_hung_store_are_misses_within_the_deadline_then_at_once(
    kind: str, server: SilentServer
) -> None:
    """contains/batched_contains of RemoteBackend and HybridBackend: a miss within the lookup
    deadline while the store hangs, and at once (no thread hop to the store) once its breaker is
    open; with a backend timeout shorter than the store's deadline, a miss at that timeout."""
    store = hung_store(kind, server.url, lookup_timeout_secs=0.5, request_timeout_secs=1, breaker_failures=3,
                       breaker_cooldown_secs=600)
    remote = RemoteBackend(store, LAYOUT)
    cpu = LocalCPUBackend(1 << 22)
    h = HybridBackend([cpu, remote])
    short = RemoteBackend(store, LAYOUT, blocking_timeout_secs=0.2, owns_store=False)
    try:
        cpu.put("here", np.zeros(FULL, dtype=np.uint8))
        t0 = time.monotonic()
        assert short.contains("a") is False and short.batched_contains(["b", "c"]) == [False, False]
        assert elapsed(t0) < 1.0 and short.lookup_failures == 3  # 2 x 0.2 s, not the store's 0.5 s
        t0 = time.monotonic()
        assert h.contains("x") is False
        assert h.batched_contains(["here", "y"]) == [True, False]
        assert elapsed(t0) < 2.5  # two lookups of 0.5 s (and the short ones' late ends)
        deadline = time.monotonic() + 5
        while store.breaker.state is not OPEN and time.monotonic() < deadline:
            h.contains("z")
        assert store.breaker.state is OPEN
        times = []
        for i in range(200):
            t0 = time.perf_counter()
            assert h.batched_contains([f"m{i}"]) == [False] and remote.contains(f"n{i}") is False
            times.append(time.perf_counter() - t0)
        assert statistics.median(times) < 0.001  # no thread hop, no store call
        assert remote.lookup_failures >= 400
    finally:
        short.close()
        h.close()
        store.close()


def test_flush_is_bounded_and_says_what_did_not_land(server: SilentServer) -> None:
    """flush(timeout) over a hung store returns at its timeout with the puts still pending, then
    with the ones that failed; a healthy tier's flush is true (was: flush() waited forever)."""
    store = hung_store("hf", server.url, store_timeout_secs=0.5, request_timeout_secs=1)
    remote = RemoteBackend(store, LAYOUT)
    cpu = LocalCPUBackend(1 << 22)
    h = HybridBackend([cpu, remote])
    try:
        chunk = np.arange(FULL, dtype=np.uint8)
        for i in range(3):
            h.put(f"k{i}", chunk, blocking=False)
        t0 = time.monotonic()
        res = h.flush(timeout=0.2)
        assert elapsed(t0) < 1.0
        assert not res and res.pending == 3 and res.failed == 0  # queued or in progress: not stored
        t0 = time.monotonic()
        res = h.flush(timeout=10)
        assert elapsed(t0) < 5.0  # three store deadlines of 0.5 s, one after the other
        assert not res and res.pending == 0 and res.failed == 3
        assert h.flush(timeout=1)  # nothing new since: true
        assert cpu.contains("k0") and not any(remote.contains(f"k{i}") for i in range(3))
    finally:
        h.close()
        store.close()


def test_a_call_the_backend_gives_up_on_reaches_the_breaker_at_once(server: SilentServer) -> None:
    """RemoteBackend's blocking_timeout_secs shorter than the store's deadline: each abandoned
    lookup counts as a failed call when the backend gives up (not when the store's 5 s deadline
    ends it), so the breaker opens after two of them."""
    store = hung_store("hf", server.url, lookup_timeout_secs=5.0, request_timeout_secs=5, breaker_failures=2,
                       breaker_cooldown_secs=600)
    b = RemoteBackend(store, LAYOUT, blocking_timeout_secs=0.3)
    try:
        t0 = time.monotonic()
        assert b.contains("a") is False and b.contains("b") is False
        assert store.breaker.state is OPEN and elapsed(t0) < 1.5  # was: closed until 5 s
        t0 = time.perf_counter()
        assert b.contains("c") is False and time.perf_counter() - t0 < 0.05
    finally:
        b.close()
        store.close()


def test_a_full_put_queue_drops_non_blocking_puts_after_its_wait_instead_of_stalling(
        server: SilentServer) -> None:
    """Non-blocking puts into a hung store: the queue fills, then each further put waits at most
    queue_full_wait_secs and is dropped (an error for that item, counted, never stored); the fast
    tier keeps the chunk (was: the engine's put blocked until the store's deadlines freed room)."""
    store = hung_store("hf", server.url, store_timeout_secs=2, request_timeout_secs=30, breaker_failures=0)
    remote = RemoteBackend(store, LAYOUT, queue_size=2, queue_full_wait_secs=0.2)
    cpu = LocalCPUBackend(1 << 22)
    h = HybridBackend([cpu, remote])
    try:
        chunk = np.arange(FULL, dtype=np.uint8)
        t0 = time.monotonic()
        results = remote.batched_put_results([(f"k{i}", chunk) for i in range(6)], blocking=False)
        took = elapsed(t0)
        # one put in the worker (stuck), two queued, three dropped after 0.2 s each
        errors = [r for r in results if r is not None]
        assert len(errors) == 3 and all("put queue stayed full" in str(e) for e in errors), results
        assert took < 2.0 and remote._queue.dropped_full == 3  # was: until the store freed room (4+ s)
        t0 = time.monotonic()
        # through the hybrid: no stall; the CPU tier stores it, the remote refusal is reported
        with pytest.raises(TierPutError, match="put queue stayed full"):
            h.put("k9", chunk, blocking=False)
        assert elapsed(t0) < 1.0 and cpu.contains("k9")
        dropped = {f"k{i}" for i, r in enumerate(results) if r is not None} | {"k9"}
        assert not dropped & set(remote._queue.pending_keys())  # nothing dropped looks stored
    finally:
        h.close()
        store.close()
