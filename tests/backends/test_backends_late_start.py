"""A remote tier's ``get_into`` that returns False leaves the buffer to its caller: a load that
waited too long for one of the tier's io threads is not started (kvbucket.backends.late_start).

An outside tester ran loads from several threads through ``RemoteBackend`` on a slow store (Hub
and S3, default settings, 3.5 s a chunk): callers queued behind the others got False at
``blocking_timeout_secs``, and their loads then ran and wrote the chunk into buffers the callers
had taken back (17 of 17).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

from kvbucket.backends import RemoteBackend
from kvbucket.backends.late_start import GRACE_SECS, LateStart, load_budget
from kvbucket.chunks import KVLayout
from kvbucket.errors import TransientStoreError
from kvbucket.stores.deadline import LOAD_START_BY
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.local.memory import MemoryStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", chunk_tokens=16)
FULL = LAYOUT.full_chunk_bytes


def test_loads_queued_too_long_are_refused_and_no_returned_buffer_is_written(
    hub_bucket: Any, hub_faults: Any
) -> None:
    hub = hub_bucket.hub
    store = HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/late-{uuid.uuid4().hex[:6]}",
        token=hub.write_token, token_env="", endpoint=hub.endpoint, load_timeout_secs=1.5,
        breaker_failures=0, metadata_cache_ttl_secs=0))
    # room for a call to wait for the one io thread: 3.0 - 1.5 - GRACE_SECS = 1.0 s
    b = RemoteBackend(store, LAYOUT, blocking_timeout_secs=3.0, io_threads=1)
    try:
        chunks = {f"k{i}": np.random.default_rng(i).integers(0, 256, FULL, dtype=np.uint8) for i in range(3)}
        for k, c in chunks.items():
            b.put(k, c)
        assert b.flush()
        hub_faults.add("fetch", latency_s=1.2)  # each load takes ~1.2 s, within the store's 1.5 s
        store._client.reset_download_group()
        bufs = {k: np.zeros(FULL, dtype=np.uint8) for k in chunks}
        got: dict[str, bool] = {}
        returned: dict[str, float] = {}

        def load(k: str) -> None:
            got[k] = b.get_into(k, bufs[k])
            returned[k] = time.monotonic()
            if not got[k]:
                bufs[k][:] = 0xEE  # the caller takes its buffer back at once

        threads = [threading.Thread(target=load, args=(k,)) for k in chunks]
        t0 = time.monotonic()
        for t in threads:
            t.start()
            time.sleep(0.05)  # k0 takes the io thread; k1 and k2 queue behind it
        for t in threads:
            t.join(15)
        time.sleep(3.0)  # any load still running ends by now (the store's 1.5 s deadline)
        missed = [k for k in chunks if not got[k]]
        assert missed, f"no load waited past its room: {got}"
        for k in missed:  # a miss returned: its buffer is only what the caller put there
            assert (bufs[k] == 0xEE).all(), f"{k}'s buffer was written after get_into returned False"
            assert returned[k] - t0 < 3.0, "refused at once, not at blocking_timeout_secs"
        for k in chunks:
            if got[k]:
                assert (bufs[k] == chunks[k]).all()
        assert b.read_failures >= len(missed)
    finally:
        hub_faults.reset()
        b.close()


def test_the_room_is_the_tiers_bound_less_the_stores_load_deadline() -> None:
    hub_cfg = build_config(bucket_handle="hf://buckets/me/x", token="t", token_env="", load_timeout_secs=5.0)

    class Hub:
        config = hub_cfg

    assert load_budget(Hub()) == 5.0
    assert load_budget(MemoryStore("m")) is None  # no load deadline named: no guard
    assert LateStart(Hub(), 10.0).room == 10.0 - 5.0 - GRACE_SECS
    assert LateStart(Hub(), 5.0).room is None  # the tier's bound is no longer than the store's
    assert LateStart(Hub(), None).room is None
    late = LateStart(Hub(), 10.0)
    late.room = 0.05
    call = late.guard(lambda *a: "ran")
    assert call() == "ran"
    call = late.guard(lambda *a: "ran")
    time.sleep(0.1)
    try:
        call()
        raise AssertionError("a call started past its room ran")
    except TransientStoreError as e:
        assert "io_threads" in str(e) and "untouched" in str(e)


def _store(kind: str, request: Any) -> Any:
    if kind == "hub":
        hb = request.getfixturevalue("hub_bucket")
        return HFBucketStore(build_config(
            bucket_handle=f"hf://buckets/{hb.bucket_id}/again-{uuid.uuid4().hex[:6]}",
            token=hb.hub.write_token, token_env="", endpoint=hb.hub.endpoint))
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store

    server, bucket = request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket")
    return S3Store(S3Config.parse(server.config(bucket)))


@pytest.mark.parametrize("kind", ["hub", "s3"])
def test_a_further_load_of_a_guarded_call_past_its_start_bound_is_refused(kind: str, request: Any) -> None:
    """A guard layer's second load in one call (a read-ahead asked again after its own load
    failed: attack41h's FAIL E, a second 5 s load past the tier's bound) is held to the instant
    the first one was: the store refuses it without touching the buffers."""
    store = _store(kind, request)
    try:
        data = bytes(range(256)) * 64
        assert store.put_many([("n", data)])[0].ok
        late = LateStart(store, 10.0)
        late.room = 0.3

        def call(names: list[str], bufs: list[Any]) -> list[Any]:
            first = store.get_many(names, bufs)  # in time
            assert first[0].ok and bytes(bufs[0]) == data
            bufs[0][:] = b"\xee" * len(data)
            time.sleep(0.5)  # the first load took long: a second one would end past the bound
            return store.get_many(names, bufs)

        (r,) = late.guard(call)(["n"], [bytearray(len(data))])
        assert isinstance(r.error, TransientStoreError) and "untouched" in str(r.error), r
        buf = bytearray(len(data))
        token = LOAD_START_BY.set(time.monotonic() - 1.0)
        try:
            assert store.get_many(["n"])[0].ok  # no caller buffer: nothing to hold back
            (r,) = store.get_many(["n"], [buf])
            assert r.error is not None and buf == bytearray(len(data))
        finally:
            LOAD_START_BY.reset(token)
        assert store.get_many(["n"], [buf])[0].ok and buf == data  # outside a guarded call: as before
    finally:
        store.close()


def test_loads_waiting_for_an_io_thread_when_the_tier_closes_are_misses_not_exceptions() -> None:
    """attack41h's FAIL F: a caller still queued at close() got a bare CancelledError out of
    get_into, and get_into after close() a RuntimeError ("cannot schedule new futures")."""

    class Slow(MemoryStore):
        def get_many(self, names: Any, out: Any = None) -> Any:
            time.sleep(0.5)
            return super().get_many(names, out)

    b = RemoteBackend(Slow("slow"), LAYOUT, io_threads=1)
    chunk = np.random.default_rng(0).integers(0, 256, FULL, dtype=np.uint8)
    b.put("k", chunk)
    assert b.flush()
    got: list[Any] = []

    def load() -> None:
        try:
            got.append(b.get_into("k", np.zeros(FULL, dtype=np.uint8)))
        except BaseException as e:
            got.append(e)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # one load runs, two wait for the io thread
    b.close()
    for t in threads:
        t.join(10)
    assert all(isinstance(g, bool) for g in got), got
    assert got.count(False) >= 2
    assert b.get_into("k", np.zeros(FULL, dtype=np.uint8)) is False


def test_a_damaged_load_read_again_past_the_start_bound_is_a_miss_not_a_late_copy(
    seaweedfs: Any, s3_bucket: str, fault_proxy: Any
) -> None:
    """attack41i's FAIL G: the sealed layer reads an object refused as damaged again and, when that
    read is intact (damage on the wire), copies it into the caller's buffer: a copy that came
    after the tier had returned False (a bit flipped by a proxy, 3.5 s a request). The copy is
    made only while the call is within its start bound; later the item is a miss."""
    import os

    from kvbucket.stores.guard.sealed import seal_store
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store
    from kvbucket.testing.fault_proxy import FLIP

    raw = S3Store(S3Config.parse(seaweedfs.config(s3_bucket, s3_endpoint_url=fault_proxy.url)))
    data = os.urandom(64 << 10)
    with seal_store(raw, tier="late-wire") as s:
        s.put("n", data)
        real = raw.get_versions

        def slow_again(names: Any) -> Any:  # the re-read takes long
            time.sleep(0.5)
            return real(names)

        raw.get_versions = slow_again  # type: ignore[method-assign]
        late = LateStart(raw, 10.0)
        for room, served in ((5.0, True), (0.2, False)):
            late.room = room
            into = bytearray(len(data))
            fault_proxy.fail(FLIP, times=1, methods={"GET"})
            (r,) = late.guard(s.get_many)(["n"], [into])
            assert fault_proxy.injected >= 1
            assert r.found is served, (room, r)
            assert (bytes(into) == data) is served  # past the bound: no copy of the re-read bytes
