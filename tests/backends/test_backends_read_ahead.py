"""Read-ahead (kvbucket.stores.guard.read_ahead) through the backend API: ``contains`` then ``get``.

A lookup hit starts the load into a bounded buffer; the load takes the bytes there (no new
request once they landed, none of its own while they are on their way). Checked against a
counting store, the Hub emulator's request counts and the S3 proxy's request log; the bound,
expiry, the off switch, the metrics and the integrity check of read-ahead bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig, build_backend
from kvbucket.errors import DeadlineExceededError
from kvbucket.keys import as_key_string, key_to_name
from kvbucket.metrics import INTEGRITY_FAILURES, READ_AHEAD_BYTES
from kvbucket.stores.base import Buffer, ItemResult
from kvbucket.stores.guard.breaker import CircuitBreaker
from kvbucket.stores.guard.read_ahead import PrefetchStore
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.fleet_node import until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, dtype="bfloat16", chunk_tokens=64)
FULL = LAYOUT.full_chunk_bytes
ON = ReadAheadSettings(True, 64 * FULL, 10.0)

assert READ_AHEAD_BYTES is not None  # re-exported by kvbucket.metrics


def metric(outcome: str, store: str) -> float:
    """A read-ahead counter of one store (labelled with its URL, as its other series are)."""
    labels = {"store": store, "outcome": outcome}
    return REGISTRY.get_sample_value("kvbucket_read_ahead_bytes_total", labels) or 0.0


class GatedStore(CountingStore):
    """Counts calls; ``gate`` (when set) holds every get_many until it is opened, and ``peak``
    records the read-ahead buffer's largest held bytes seen while reads were held."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate: threading.Event | None = None
        self.watch: PrefetchStore | None = None
        self.peak = 0
        self.entered = 0  # get_many calls started (counted before the gate)

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        if self.watch is not None:
            self.peak = max(self.peak, self.watch.held_bytes)
        self.entered += 1
        if self.gate is not None:
            self.gate.wait(10)
        return super().get_many(names, out)


@pytest.fixture
def raw() -> GatedStore:
    return GatedStore(MemoryStore())


def backend_on(store: Any, settings: ReadAheadSettings | None = ON) -> RemoteBackend:
    return RemoteBackend(store, LAYOUT, read_ahead=settings, owns_store=False)


def fill(store: Any, n: int) -> list[bytes]:
    chunks = [chunk_bytes(LAYOUT, i) for i in range(n)]
    with backend_on(store, None) as b:
        assert b.batched_put([(key(i), c) for i, c in enumerate(chunks)]) == n
    return chunks


def test_a_load_after_a_lookup_hit_makes_no_request(raw: GatedStore) -> None:
    chunks = fill(raw, 6)
    keys = [key(i) for i in range(6)]
    before = (metric("prefetched", raw.url), metric("used", raw.url))
    with backend_on(raw) as b:
        assert isinstance(b.reads, PrefetchStore)
        raw.reset()
        assert b.batched_contains(keys) == [True] * 6
        assert b.reads.settle()
        assert raw.calls["get"] == 1 and raw.items["get"] == 6  # one batch for the whole hit
        raw.reset()
        got = b.batched_get(keys)
        assert [as_bytes(c) for c in got] == chunks  # type: ignore[arg-type]
        assert raw.total_calls == 0  # every byte came from the read-ahead
        # get_into as well (engines' buffers): a lookup then a load into caller buffers
        assert b.batched_contains(keys[:2]) == [True, True]
        assert b.reads.settle()
        raw.reset()
        bufs = [np.empty(FULL, np.uint8) for _ in range(2)]
        assert b.batched_get_into(keys[:2], bufs) == [True, True]
        assert [x.tobytes() for x in bufs] == chunks[:2]
        assert raw.total_calls == 0
        assert b.reads.held_bytes == 0
    assert metric("prefetched", raw.url) - before[0] == 8 * FULL
    assert metric("used", raw.url) - before[1] == 8 * FULL


def test_a_load_waits_for_a_read_ahead_on_its_way(raw: GatedStore) -> None:
    chunks = fill(raw, 4)
    keys = [key(i) for i in range(4)]
    with backend_on(raw) as b:
        raw.reset()
        raw.gate = threading.Event()
        assert b.batched_contains(keys) == [True] * 4  # the read-ahead is now held at the gate
        result: list[Any] = []
        loader = threading.Thread(target=lambda: result.append(b.batched_get(keys)))
        loader.start()
        assert until(lambda: raw.entered == 1, 5)
        raw.gate.set()
        loader.join(10)
        assert [as_bytes(c) for c in result[0]] == chunks
        assert raw.calls["get"] == 1 and raw.entered == 1  # the load sent nothing of its own


def test_the_buffer_never_exceeds_its_bound(raw: GatedStore) -> None:
    chunks = fill(raw, 10)
    keys = [key(i) for i in range(10)]
    before = metric("wasted", raw.url)
    with backend_on(raw, ReadAheadSettings(True, 3 * FULL + 10, 10.0)) as b:
        assert isinstance(b.reads, PrefetchStore)
        raw.watch = b.reads
        raw.reset()
        raw.gate = threading.Event()
        assert b.batched_contains(keys) == [True] * 10
        assert b.reads.held_bytes == 3 * FULL  # the first three; the rest would pass the bound
        assert b.batched_contains(keys) == [True] * 10  # a second lookup adds nothing
        assert b.reads.held_bytes == 3 * FULL
        raw.gate.set()
        assert b.reads.settle()
        got = b.batched_get(keys)
        assert [as_bytes(c) for c in got] == chunks  # type: ignore[arg-type]
        assert raw.items["get"] == 10  # 3 read ahead + 7 asked by the load
        assert raw.peak <= 3 * FULL + 10
        # A lookup never followed by a load wastes at most the bound.
        assert b.batched_contains(keys) == [True] * 10
        assert b.reads.settle()
    assert metric("wasted", raw.url) - before == 3 * FULL  # dropped at close


def test_untaken_read_aheads_expire(raw: GatedStore) -> None:
    chunks = fill(raw, 3)
    keys = [key(i) for i in range(3)]
    before = metric("wasted", raw.url)
    with backend_on(raw, ReadAheadSettings(True, 64 * FULL, 0.1)) as b:
        assert isinstance(b.reads, PrefetchStore)
        assert b.batched_contains(keys) == [True] * 3
        assert b.reads.settle()
        assert until(lambda: b.reads.held_bytes == 0, 5)  # the sweeper drops them, no call needed
        assert metric("wasted", raw.url) - before == 3 * FULL
        raw.reset()
        assert [as_bytes(c) for c in b.batched_get(keys)] == chunks  # type: ignore[arg-type]
        assert raw.items["get"] == 3  # fetched again


def test_read_ahead_can_be_turned_off(raw: GatedStore) -> None:
    fill(raw, 3)
    keys = [key(i) for i in range(3)]
    with backend_on(raw, ReadAheadSettings(False)) as b:
        assert not isinstance(b.reads, PrefetchStore)
        raw.reset()
        assert b.batched_contains(keys) == [True] * 3
        assert raw.calls["get"] == 0
    cfg = EngineConfig.from_dict({"chunk_size": 64, "local_cpu": False, "remote_url": "memory://ra-off",
                                  "extra_config": {"read_ahead": False}})
    with build_backend(cfg, LAYOUT) as b:
        assert not isinstance(b.reads, PrefetchStore)  # type: ignore[attr-defined]
    cfg = EngineConfig.from_dict({"chunk_size": 64, "local_cpu": False, "remote_url": "memory://ra-on",
                                  "extra_config": {"read_ahead_max_gb": 0.5, "read_ahead_ttl_secs": 3}})
    with build_backend(cfg, LAYOUT) as b:
        store = b.reads  # type: ignore[attr-defined]
        assert isinstance(store, PrefetchStore)
        assert store.settings == ReadAheadSettings(True, 512 * 1024**2, 3.0)


def test_a_write_after_the_lookup_is_what_the_load_sees(raw: GatedStore) -> None:
    fill(raw, 2)
    with backend_on(raw) as b:
        assert b.batched_contains([key(0), key(1)]) == [True, True]
        assert b.reads.settle()
        new = chunk_bytes(LAYOUT, 99)
        b.put(key(0), new)
        b.remove(key(1))
        assert as_bytes(b.get(key(0))) == new
        assert b.get(key(1)) is None
        assert b.reads.held_bytes == 0


class HeldWrites(CountingStore):
    """Holds every put and delete (before it touches the store) until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.holding = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def _hold(self) -> None:
        if not self.release.is_set():
            self.holding.set()
            assert self.release.wait(10)

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        self._hold()
        return super().put_many(items)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._hold()
        return super().delete_many(names)


def during_held_write(raw: HeldWrites, write: Any, lookup: Any, settle: Any) -> None:
    """Run ``write`` held in the store, ``lookup`` meanwhile (its read-ahead reads the old bytes
    and lands), then let the write finish and return once it returned."""
    raw.release.clear()
    t = threading.Thread(target=write)
    t.start()
    assert raw.holding.wait(10)
    lookup()
    assert settle()
    raw.release.set()
    t.join(10)
    assert not t.is_alive()


def test_a_lookup_during_a_put_does_not_serve_the_old_bytes_after_it() -> None:
    """Issue 29 item 9: the lookup's read-ahead read the old bytes while the put was on its way;
    the load comes after the put returned, so it must get the new bytes."""
    raw = HeldWrites(MemoryStore())
    fill(raw, 1)
    new = chunk_bytes(LAYOUT, 77)
    with backend_on(raw) as b:
        during_held_write(raw, lambda: b.put(key(0), new), lambda: b.contains(key(0)), b.reads.settle)
        assert as_bytes(b.get(key(0))) == new


@pytest.mark.parametrize("verb", ["put", "delete"])
def test_a_read_ahead_begun_during_a_write_through_the_store_is_not_served_after_it(verb: str) -> None:
    """The same through PrefetchStore's own put_many/delete_many (the L2 adapter, the LMCache
    connector, SGLang and vLLM write through it): a deleted name is a miss, a rewritten one new."""
    from kvbucket.stores.guard.sealed import seal_store

    raw = HeldWrites(MemoryStore())
    sealed = seal_store(raw, tier="l2")
    old, new = chunk_bytes(LAYOUT, 1), chunk_bytes(LAYOUT, 2)
    sealed.put("n", old)
    pf = PrefetchStore(sealed, ON, label="held-writes")
    try:
        write = (lambda: pf.put_many([("n", new)])) if verb == "put" else (lambda: pf.delete_many(["n"]))
        during_held_write(raw, write, lambda: pf.prefetch(["n"], [len(old)]), pf.settle)
        (r,) = pf.get_many(["n"])
        assert (bytes(r.data) if r.found else None) == (new if verb == "put" else None)
    finally:
        pf.close()


class SlowStore(CountingStore):
    """A remote store whose loads, while ``slow`` is set, each take its whole load budget and then
    fail with DeadlineExceededError, as a store honouring its deadline does."""

    def __init__(self, inner: Any, budget: float) -> None:
        super().__init__(inner)
        self.breaker = CircuitBreaker("slow", failures=0, budgets={"get": budget})
        self.budget = budget
        self.slow = False
        self.entered = threading.Event()

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        self._count("get", len(names))
        if self.slow:
            self.entered.set()
            time.sleep(self.budget)
            return [ItemResult(n, error=DeadlineExceededError("a load did not finish")) for n in names]
        return self.inner.get_many(names, out)


def budget_setup(budget: float) -> tuple[SlowStore, PrefetchStore, int]:
    from kvbucket.stores.guard.sealed import seal_store

    raw = SlowStore(MemoryStore(), budget)
    sealed = seal_store(raw, tier="l2")
    sealed.put("n", chunk_bytes(LAYOUT, 5))
    raw.reset()
    return raw, PrefetchStore(sealed, ON, label="budget"), FULL


def test_a_lookup_and_the_load_that_takes_its_read_ahead_share_one_budget() -> None:
    """Issue 29 item 4: the read-ahead ran out of time, so the load waiting for it does too; it
    sends no second request (which took another whole budget)."""
    budget = 1.0
    raw, pf, size = budget_setup(budget)
    raw.slow = True
    try:
        assert pf.prefetch(["n"], [size]) == size
        assert raw.entered.wait(10)
        t0 = time.monotonic()
        (r,) = pf.get_many(["n"], [np.empty(size, np.uint8)])
        took = time.monotonic() - t0
        assert isinstance(r.error, DeadlineExceededError) and not r.found
        assert raw.calls["get"] == 1  # the read-ahead's request only
        assert took < 1.5 * budget  # two budgets: ~2 x budget
    finally:
        pf.close()


def test_a_load_after_its_read_ahead_ran_out_of_time_gets_a_budget_of_its_own() -> None:
    """A load that begins once the read-ahead's budget is over is a new load: it asks the store."""
    raw, pf, size = budget_setup(0.3)
    raw.slow = True
    try:
        assert pf.prefetch(["n"], [size]) == size
        assert pf.settle()  # failed at its deadline, before the load began
        raw.slow = False
        buf = np.empty(size, np.uint8)
        (r,) = pf.get_many(["n"], [buf])
        assert r.found and buf.tobytes() == chunk_bytes(LAYOUT, 5)
        assert raw.calls["get"] == 2
    finally:
        pf.close()


def test_read_ahead_bytes_are_verified_like_a_load(raw: GatedStore) -> None:
    chunks = fill(raw, 2)
    name = key_to_name(as_key_string(key(1)), "")
    blob = bytearray(raw.inner.get(name))  # type: ignore[attr-defined]
    blob[-1] ^= 0xFF  # one flipped payload bit, same size
    raw.inner.put(name, bytes(blob))  # type: ignore[attr-defined]
    failures = integrity_failures()
    before_used = metric("used", raw.url)
    with backend_on(raw) as b:
        assert b.batched_contains([key(0), key(1)]) == [True, True]
        assert b.reads.settle()
        got = b.batched_get([key(0), key(1)])
    assert as_bytes(got[0]) == chunks[0]
    assert got[1] is None  # refused by the check during the read-ahead, never served
    assert integrity_failures() > failures
    assert metric("used", raw.url) - before_used == FULL


def integrity_failures() -> float:
    return sum(s.value for s in INTEGRITY_FAILURES.collect()[0].samples if s.name.endswith("_total"))


# ---- real servers ------------------------------------------------------------------------


def hub_backend(hub_bucket: Any, settings: ReadAheadSettings | None, **options: Any) -> RemoteBackend:
    from kvbucket.stores.hub.config import build_config
    from kvbucket.stores.hub.store import HFBucketStore

    hub = hub_bucket.hub
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv", token=hub.write_token,
                       endpoint=hub.endpoint, token_env="", retry_backoff_secs=0.01, **options)
    return RemoteBackend(HFBucketStore(cfg), LAYOUT, read_ahead=settings)


def requests(hub: Any) -> dict[str, int]:
    return {r: s["requests"] for r, s in hub.stats()["routes"].items() if r != "control"}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {r: n - before.get(r, 0) for r, n in after.items() if n - before.get(r, 0)}


def test_hub_a_load_after_the_read_ahead_makes_no_request(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    chunks = [chunk_bytes(LAYOUT, 50 + i) for i in range(6)]
    keys = [key(50 + i) for i in range(6)]
    with hub_backend(hub_bucket, None) as b:
        assert b.batched_put(list(zip(keys, chunks, strict=True))) == 6
    # The same lookup + load, read-ahead off then on, each in a fresh store.
    seen = {}
    for mode in (None, ON):
        with hub_backend(hub_bucket, mode) as b:
            s0 = requests(hub)
            assert b.batched_contains(keys) == [True] * 6
            if mode is not None:
                assert b.reads.settle()
            s1 = requests(hub)
            got = b.batched_get(keys)
            s2 = requests(hub)
            assert [as_bytes(c) for c in got] == chunks  # type: ignore[arg-type]
            seen[mode is not None] = (delta(s1, s0), delta(s2, s1))
    (off_lookup, off_load), (on_lookup, on_load) = seen[False], seen[True]
    assert on_load == {}  # no new request: the bytes were there
    total_off = {r: off_lookup.get(r, 0) + off_load.get(r, 0) for r in {*off_lookup, *off_load}}
    assert on_lookup == total_off  # nothing fetched twice


def test_hub_a_load_during_the_read_ahead_sends_nothing_of_its_own(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    chunks = [chunk_bytes(LAYOUT, 70 + i) for i in range(4)]
    keys = [key(70 + i) for i in range(4)]
    with hub_backend(hub_bucket, None) as b:
        assert b.batched_put(list(zip(keys, chunks, strict=True))) == 4
    totals = {}
    for mode in (None, ON):
        hub.faults.add("fetch", latency_s=0.3)  # the read-ahead is still on its way at the load
        try:
            with hub_backend(hub_bucket, mode) as b:
                s0 = requests(hub)
                assert b.batched_contains(keys) == [True] * 4
                got = b.batched_get(keys)
                totals[mode is not None] = delta(requests(hub), s0)
                assert [as_bytes(c) for c in got] == chunks  # type: ignore[arg-type]
        finally:
            hub.faults.reset()
    assert totals[True] == totals[False]  # the load waited for the read-ahead: no request twice


@pytest.fixture
def s3_backend(seaweedfs: Any, s3_bucket: str, fault_proxy: Any) -> Iterator[tuple[Any, RemoteBackend]]:
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store

    def make(settings: ReadAheadSettings | None, **overrides: Any) -> RemoteBackend:
        cfg = seaweedfs.config(s3_bucket, "ra", s3_endpoint_url=fault_proxy.url, **overrides)
        cfg.pop("s3_num_io_threads")
        return RemoteBackend(S3Store(S3Config.parse(cfg)), LAYOUT, read_ahead=settings)

    yield make, fault_proxy


@pytest.mark.parametrize("settled", [True, False])
def test_s3_lookup_and_load_with_read_ahead_in_two_round_trips(s3_backend: Any, settled: bool) -> None:
    make, proxy = s3_backend
    chunks = [chunk_bytes(LAYOUT, 90 + i) for i in range(16)]
    keys = [key(90 + i) for i in range(16)]
    with make(None) as b:
        assert b.batched_put(list(zip(keys, chunks, strict=True))) == 16
    proxy.latency = 0.8  # longer than the spread of a batch's arrivals on a machine busy with other tests
    # (a lookup's budget well past the latency: at the default 1 s, a loaded machine made the 0.8 s
    # HEADs a timeout, and the test was about round trips)
    with make(ON, s3_lookup_timeout_secs=10.0) as b:
        start = len(proxy.log)
        assert b.batched_contains(keys) == [True] * 16
        if settled:
            assert b.reads.settle()
        mark = len(proxy.log)
        got = b.batched_get(keys)
        assert [as_bytes(c) for c in got] == chunks  # type: ignore[arg-type]
        log = proxy.log[start:]
        gets = [t for m, t, _, _ in log if m == "GET" and "list-type" not in t]
        assert len(gets) == 16  # each object fetched once
        assert sum(m == "HEAD" for m, _, _, _ in log) == 16
        if settled:
            assert len(proxy.log) == mark  # the load sent nothing
        assert proxy.round_trips(start) == 2


def test_hub_a_load_taking_a_slow_read_ahead_ends_within_one_load_budget(hub_bucket: Any, hub_faults: Any
                                                                         ) -> None:
    """Issue 29 item 4 on a Hub bucket: every Xet fetch outlasts load_timeout_secs; the load that
    comes 0.2 s after its lookup sends no fetch of its own and ends within one budget."""
    hub, budget = hub_bucket.hub, 1.5
    with hub_backend(hub_bucket, None) as b:
        assert b.batched_put([(key(71), chunk_bytes(LAYOUT, 71))]) == 1
    with hub_backend(hub_bucket, ON, load_timeout_secs=budget, breaker_failures=0) as b:
        hub_faults.add("fetch", latency_s=4 * budget)
        s0 = requests(hub)
        assert b.contains(key(71))
        time.sleep(0.2)
        t0 = time.monotonic()
        assert b.get(key(71)) is None  # a miss: the read ran out of time
        took = time.monotonic() - t0
        assert requests(hub).get("fetch", 0) - s0.get("fetch", 0) == 1  # the read-ahead's only
        assert took < 1.5 * budget  # one budget (two took ~2 x budget - 0.2 s)


def test_s3_a_load_taking_a_slow_read_ahead_ends_within_one_load_budget(s3_backend: Any) -> None:
    """Issue 29 item 4: every body trickles (a fetch outlasts s3_load_timeout_secs); a load that
    comes 0.2 s after its lookup waits for the lookup's read-ahead until that read's deadline and
    sends no request of its own (it took a second budget: 2 GETs and about twice the time)."""
    make, proxy = s3_backend
    budget = 1.5
    with make(None) as b:
        assert b.batched_put([(key(70), chunk_bytes(LAYOUT, 70))]) == 1
    with make(ON, s3_load_timeout_secs=budget, s3_breaker_failures=0) as b:
        proxy.trickle(0.05, times=5, methods={"GET"})
        start = len(proxy.log)
        assert b.contains(key(70))
        time.sleep(0.2)
        t0 = time.monotonic()
        assert b.get(key(70)) is None  # a miss: the read ran out of time
        took = time.monotonic() - t0
        proxy.clear()
        gets = [t for m, t, _, _ in proxy.log[start:] if m == "GET"]
        assert len(gets) == 1, gets  # the read-ahead's only
        assert took < 1.5 * budget  # one budget (two took ~2 x budget - 0.2 s)


def test_the_docs_example_builds_a_tier_with_those_settings() -> None:
    """docs/read-ahead.md's engine config, as a user would load it (S3 options swapped for a
    memory store, which opens without a server)."""
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).parents[2] / "docs" / "read-ahead.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    cfg = yaml.safe_load(block)
    cfg["remote_url"] = "memory://ra-doc"
    del cfg["extra_config"]["s3_region"]
    engine = EngineConfig.from_dict({**cfg, "local_cpu": False})
    with build_backend(engine, LAYOUT.with_chunk_tokens(256)) as b:
        reads = b.reads  # type: ignore[attr-defined]
        assert isinstance(reads, PrefetchStore)
        assert reads.settings == ReadAheadSettings(True, 512 * 1024**2, 5.0)


@pytest.mark.parametrize(("key_name", "value", "allowed"), [
    ("read_ahead_ttl_secs", 1e300, "a number of seconds above 0, at most 86400"),
    ("read_ahead_ttl_secs", 0, "a number of seconds above 0, at most 86400"),
    ("read_ahead_max_gb", float("inf"), "a number of GB from 0 to 1024"),
    ("read_ahead_max_gb", float("nan"), "a number of GB from 0 to 1024"),
    ("read_ahead_max_gb", -1, "a number of GB from 0 to 1024"),
])
def test_out_of_range_read_ahead_settings_are_config_errors(key_name: str, value: float,
                                                            allowed: str) -> None:
    """Issue 29 item 13: a TTL of 1e300 s was accepted (the sweeper then died with OverflowError)
    and read_ahead_max_gb=inf raised a raw OverflowError. Every config surface now refuses them
    with a ConfigError naming the key and the allowed range."""
    from kvbucket.errors import ConfigError
    from kvbucket.integrations.sglang import SGLangStorageSettings
    from kvbucket.integrations.vllm import VLLMTierSettings
    from kvbucket.l2.registry import parse_l2_config

    surfaces = {
        "engine config": lambda: build_backend(EngineConfig.from_dict(
            {"chunk_size": 64, "local_cpu": False, "remote_url": "memory://ra-range",
             "extra_config": {key_name: value}}), LAYOUT),
        "L2 adapter": lambda: parse_l2_config({"type": "fs", "base_path": "/tmp/kv", key_name: value}),
        "SGLang": lambda: SGLangStorageSettings.from_extra_config(
            {"store_url": "memory://x", key_name: value}),
        "vLLM": lambda: VLLMTierSettings.from_tier_config({"store_url": "memory://x", key_name: value}),
        "the library": lambda: ReadAheadSettings(True, **(
            {"ttl_secs": value} if key_name == "read_ahead_ttl_secs" else {"max_bytes": value * 1024**3})),
    }
    for where, make in surfaces.items():
        with pytest.raises(ConfigError) as info:
            make()
        assert key_name in str(info.value) and allowed in str(info.value), (where, str(info.value))
