"""Ranged S3 reads against answers a well-behaved test server never gives (issue 41's outside
tester, cases race_weed, ignore_link, threads): a range of another version of the object, a
server ignoring Range, and many loads sharing one store's connection budget. Through a
FaultProxy in front of SeaweedFS."""

from __future__ import annotations

import numpy as np

from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import FaultProxy, S3Server

_KiB = 1 << 10


def open_store(server: S3Server, bucket: str, url: str, **overrides: object) -> S3Store:
    return S3Store(S3Config.parse(server.config(bucket, "ranged-faults", s3_endpoint_url=url, **overrides)))


def gets(proxy: FaultProxy) -> tuple[int, int]:
    """(presigned GETs, header-signed GETs: obstore's whole re-reads) the proxy answered."""
    targets = [t for m, t in proxy.answered if m == "GET" and "list-type" not in t]
    presigned = sum("X-Amz-Signature=" in t for t in targets)
    return presigned, len(targets) - presigned


def test_a_range_of_another_version_is_never_a_hit(seaweedfs: S3Server, s3_bucket: str,
                                                   fault_proxy: FaultProxy) -> None:
    """(case_race_weed) A writer replacing a same-size object while its ranges are in flight:
    the third range comes from the other version (other bytes, other ETag). The raw load (no
    checksum to catch it) must not join the two versions: it reads the object again whole, once."""
    data = np.random.default_rng(41).integers(0, 256, 1 << 20, dtype=np.uint8)
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=16,
                    s3_read_part_bytes=256 * _KiB) as store:
        store.put("big", data)
        assert store._direct is not None
        before = gets(fault_proxy)
        fault_proxy.new_version(times=1, skip=2)
        out = np.zeros_like(data)
        (r,) = store.get_many(["big"], [out])
        assert fault_proxy.injected == 1
        assert r.ok and np.array_equal(out, data)
        assert store._direct.mixed_versions == 1
        after = gets(fault_proxy)
        assert (after[0] - before[0], after[1] - before[1]) == (4, 1)  # 4 ranges, then 1 whole GET


def test_a_server_ignoring_range_costs_one_object_not_one_per_range(seaweedfs: S3Server, s3_bucket: str,
                                                                      fault_proxy: FaultProxy) -> None:
    """(case_ignore_link) A server or proxy that ignores Range answers every ranged GET 200 with
    the whole object: each such transfer stops at its first bytes and the object is read whole
    once through obstore. Before, every range downloaded the whole object (16 ranges: 17x)."""
    size = 4 << 20
    data = np.random.default_rng(43).integers(0, 256, size, dtype=np.uint8)
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=16,
                    s3_read_part_bytes=256 * _KiB) as store:
        store.put("big", data)
        before = gets(fault_proxy)
        fault_proxy.ignore_range(times=1000, per_piece_secs=0.002)  # 64 KiB pieces: a slow link
        sent = fault_proxy.body_bytes
        out = np.zeros_like(data)
        (r,) = store.get_many(["big"], [out])
        sent = fault_proxy.body_bytes - sent
        assert r.ok and np.array_equal(out, data)
        assert gets(fault_proxy)[1] - before[1] == 1  # read whole once, through obstore
        assert sent < 2.5 * size, sent / size  # about the object once, not once per range


def test_concurrent_loads_share_the_stores_connection_budget(seaweedfs: S3Server, s3_bucket: str,
                                                              fault_proxy: FaultProxy) -> None:
    """(case_threads) s3_num_io_threads bounds the store's GETs in flight, not each call's: four
    threads loading at once on one store with a budget of 4 never have more than 4 requests at
    the server (each call had its own 4 before: up to 16), and every byte is right."""
    import threading

    rng = np.random.default_rng(44)
    data = [rng.integers(0, 256, 512 * _KiB, dtype=np.uint8) for _ in range(16)]
    names = [f"c{i}" for i in range(16)]
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=4,
                    s3_read_part_bytes=128 * _KiB, s3_read_min_part_bytes=64 * _KiB) as store:
        assert all(r.ok for r in store.put_many(list(zip(names, data, strict=True))))
        fault_proxy.latency = 0.05  # every request held a while: overlaps show
        fault_proxy.peak_in_flight = 0
        wrong: list[str] = []

        def load(k: int) -> None:
            mine = names[4 * k : 4 * k + 4]
            outs = [np.zeros_like(d) for d in data[4 * k : 4 * k + 4]]
            got = store.get_many(mine, outs)
            wrong.extend(n for n, r, o, d in zip(mine, got, outs, data[4 * k :], strict=False)
                         if not (r.ok and np.array_equal(o, d)))

        threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            fault_proxy.latency = 0.0
        assert wrong == []
        assert 2 <= fault_proxy.peak_in_flight <= 4, fault_proxy.peak_in_flight
        assert gets(fault_proxy)[1] == 0  # no fallback through obstore


def test_a_load_waiting_for_the_budget_stops_at_its_deadline(seaweedfs: S3Server, s3_bucket: str,
                                                              fault_proxy: FaultProxy) -> None:
    """Every slot of the store's budget held by other calls: a load waits for one, but never
    past its deadline (its items EXPIRED, nothing sent), and loads again once slots free up."""
    import time

    from kvbucket.stores.s3.direct import EXPIRED

    data = np.random.default_rng(45).integers(0, 256, 100_000, dtype=np.uint8)
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=2) as store:
        store.put("w", data)
        direct = store._direct
        assert direct is not None
        urls = direct.sign(["w"])
        assert urls is not None
        for _ in range(2):
            assert direct._slots.acquire(timeout=5)  # what two transfers of other calls hold
        before = gets(fault_proxy)
        t = time.monotonic()
        try:
            assert direct.fetch(urls, [np.zeros_like(data)], t + 0.3) == [EXPIRED]
            assert 0.25 <= time.monotonic() - t < 1.0
            assert gets(fault_proxy) == before  # nothing sent
        finally:
            direct._slots.release()
            direct._slots.release()
        out = np.zeros_like(data)
        (r,) = store.get_many(["w"], [out])
        assert r.ok and np.array_equal(out, data)


def test_closing_the_store_ends_a_load_waiting_for_the_budget(seaweedfs: S3Server, s3_bucket: str,
                                                              fault_proxy: FaultProxy) -> None:
    """(issue 41's second tester, d_slots) A load waiting for a transfer slot when the store is
    closed waited to its deadline and could then send a request on a closed store. Closing wakes
    it: it ends at once, its item a StoreError saying the store was closed, and nothing is sent
    (neither a presigned GET nor obstore's)."""
    import threading
    import time

    data = np.random.default_rng(46).integers(0, 256, 100_000, dtype=np.uint8)
    store = open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=2, s3_load_timeout_secs=20)
    store.put("w", data)
    direct = store._direct
    assert direct is not None
    for _ in range(2):
        assert direct._slots.acquire(timeout=5)  # what two transfers of other calls hold
    before = gets(fault_proxy)
    got: list[object] = []
    loading = threading.Thread(target=lambda: got.extend(store.get_many(["w"], [np.zeros_like(data)])))
    loading.start()
    try:
        time.sleep(0.5)
        assert loading.is_alive()  # waiting for a slot
        t = time.monotonic()
        store.close()
        loading.join(10)
        assert not loading.is_alive() and time.monotonic() - t < 2.0
    finally:
        direct._slots.release()
        direct._slots.release()
    (r,) = got
    assert not r.ok and r.error is not None and "closed" in str(r.error), r  # type: ignore[attr-defined]
    assert gets(fault_proxy) == before  # nothing sent
