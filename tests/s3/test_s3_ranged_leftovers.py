"""Ranged S3 reads, the outside tester's smaller findings after issue 41: a server whose ranged
answers carry no ETag, whole-object fallbacks beside the connection budget, and a close racing a
load's fallback. Through a FaultProxy in front of SeaweedFS."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import ACCESS_KEY, SECRET_KEY, FaultProxy, S3Server

_KiB = 1 << 10


def open_store(server: S3Server, bucket: str, url: str, **overrides: object) -> S3Store:
    return S3Store(S3Config.parse(server.config(bucket, "leftovers", s3_endpoint_url=url, **overrides)))


def gets(proxy: FaultProxy) -> tuple[int, int]:
    """(presigned GETs, header-signed GETs: obstore's whole re-reads) the proxy answered, once
    every request has been handled (a client can hold its bytes before the proxy counts them)."""
    settled = time.monotonic() + 5
    while proxy.in_flight and time.monotonic() < settled:
        time.sleep(0.005)
    targets = [t for m, t in proxy.answered if m == "GET" and "list-type" not in t]
    presigned = sum("X-Amz-Signature=" in t for t in targets)
    return presigned, len(targets) - presigned


def test_a_server_giving_ranges_no_etag_makes_the_store_read_whole(
        seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy,
        caplog: pytest.LogCaptureFixture) -> None:
    """Ranges without an ETag cannot be proven one version, so a split object is read again
    whole: every split load read it twice. The store learns it from one load: later loads read
    such objects whole (one GET, the object's bytes once), said once in the log, no secret in it."""
    size = 1 << 20
    rng = np.random.default_rng(51)
    data = {n: rng.integers(0, 256, size, dtype=np.uint8) for n in ("a", "b", "c")}
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=16,
                    s3_read_part_bytes=256 * _KiB) as store:
        assert all(r.ok for r in store.put_many(list(data.items())))
        fault_proxy.strip_etags(times=10_000)
        caplog.set_level(logging.WARNING, logger="kvbucket")
        seen: list[tuple[int, int, int]] = []
        for name in ("a", "b", "c", "a"):
            before = gets(fault_proxy)
            sent = fault_proxy.body_bytes
            out = np.zeros(size, dtype=np.uint8)
            (r,) = store.get_many([name], [out])
            assert r.ok and np.array_equal(out, data[name]), name
            after = gets(fault_proxy)  # first: it waits for the proxy's counts
            seen.append((after[0] - before[0], after[1] - before[1], fault_proxy.body_bytes - sent))
        assert seen[0] == (4, 1, 2 * size)  # 4 ranges, none with an ETag, then one whole re-read
        assert seen[1:] == [(1, 0, size)] * 3  # learnt: one GET each, the bytes once
        assert fault_proxy.injected >= 4
        said = [rec.getMessage() for rec in caplog.records if "without an ETag" in rec.getMessage()]
        assert len(said) == 1, said
        assert f"127.0.0.1:{fault_proxy.port}" in said[0]
        for secret in ("X-Amz-Signature", "X-Amz-Credential", ACCESS_KEY, SECRET_KEY):
            assert secret not in said[0]


def test_ranges_with_an_etag_keep_the_store_splitting(seaweedfs: S3Server, s3_bucket: str,
                                                      fault_proxy: FaultProxy) -> None:
    """The learning is for ETag-less ranges only: a range of another version (another ETag) is
    re-read whole once and later loads still split."""
    size = 1 << 20
    data = np.random.default_rng(52).integers(0, 256, size, dtype=np.uint8)
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=16,
                    s3_read_part_bytes=256 * _KiB) as store:
        store.put("big", data)
        fault_proxy.new_version(times=1, skip=1)
        for _ in range(2):
            out = np.zeros_like(data)
            assert store.get_many(["big"], [out])[0].ok and np.array_equal(out, data)
        assert store._direct is not None and not store._direct.whole_only
        assert gets(fault_proxy) == (8, 1)


def test_whole_object_fallbacks_share_the_stores_connection_budget(seaweedfs: S3Server, s3_bucket: str,
                                                                    fault_proxy: FaultProxy) -> None:
    """An item the direct read could not settle (here a 503 to its presigned GET) is read again
    through obstore on the store's pool: those GETs take slots of s3_num_io_threads as the direct
    reads do. A load whose 4 items all fall back beside a load of 16 direct reads, budget 4: at
    most 4 requests at the server (before: the fallbacks came on top, up to 8)."""
    rng = np.random.default_rng(53)
    data = {f"d{i:02d}": rng.integers(0, 256, 64 * _KiB, dtype=np.uint8) for i in range(16)}
    data |= {f"f{i}": rng.integers(0, 256, 64 * _KiB, dtype=np.uint8) for i in range(4)}
    with open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=4, s3_load_timeout_secs=30,
                    s3_lookup_timeout_secs=10) as store:  # a loaded machine: no first-answer cut
        assert all(r.ok for r in store.put_many(list(data.items())))
        for i in range(4):  # the presigned GET of f<i> only (obstore's path has no query)
            fault_proxy.fail(503, "SlowDown", times=1, methods={"GET"}, path_contains=f"f{i}?X-Amz-")
        fault_proxy.latency = 0.25  # every request held a while: overlaps show
        fault_proxy.peak_in_flight = 0
        wrong: list[str] = []

        def load(names: list[str]) -> None:
            outs = [np.zeros_like(data[n]) for n in names]
            got = store.get_many(names, outs)
            wrong.extend(f"{n}: {r.error}" for n, r, o in zip(names, got, outs, strict=True)
                         if not (r.ok and np.array_equal(o, data[n])))

        try:  # the two loads at once
            with ThreadPoolExecutor(2) as both:
                list(both.map(load, [[n for n in data if n[0] == k] for k in "fd"]))
        finally:
            fault_proxy.latency = 0.0
        assert wrong == []
        assert fault_proxy.injected == 4 and gets(fault_proxy)[1] == 4  # four fallbacks through obstore
        assert 3 <= fault_proxy.peak_in_flight <= 4, fault_proxy.peak_in_flight


def _closing_after_direct(store: S3Store) -> None:
    """Close ``store`` right after its direct reads return, before their fallbacks are sent: the
    window a concurrent close() hits."""
    direct = store._direct
    assert direct is not None
    fetch = direct.fetch

    def fetch_then_close(*args: object, **kw: object) -> object:
        got = fetch(*args, **kw)  # type: ignore[arg-type]
        store.close()
        return got

    direct.fetch = fetch_then_close  # type: ignore[method-assign]


def test_a_close_between_a_loads_direct_reads_and_its_fallbacks_says_closed(
        seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy) -> None:
    """The store closed after a load's direct reads, before its whole-object re-reads went to the
    (then shut down) pool: the load raised RuntimeError ("cannot schedule new futures after
    shutdown"). Each item that was not read ends with the store-was-closed error instead."""
    data = np.random.default_rng(54).integers(0, 256, 64 * _KiB, dtype=np.uint8)
    store = open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=4)
    store.put_many([("x", data), ("y", data)])
    fault_proxy.fail(503, "SlowDown", times=1, methods={"GET"}, path_contains="x?X-Amz-")
    _closing_after_direct(store)
    outs = [np.zeros_like(data), np.zeros_like(data)]
    rx, ry = store.get_many(["x", "y"], outs)
    assert ry.ok and np.array_equal(outs[1], data)  # read before the close
    assert rx.error is not None and "was closed during this call" in str(rx.error), rx.error
    assert gets(fault_proxy) == (2, 0)  # nothing sent after the close


def test_closes_racing_loads_with_fallbacks_never_raise(seaweedfs: S3Server, s3_bucket: str,
                                                        fault_proxy: FaultProxy) -> None:
    """A close from another thread at any moment of loads whose items fall back to obstore: every
    item read right or failed with a closed-store error, never a RuntimeError."""
    import random
    import threading

    data = np.random.default_rng(55).integers(0, 256, 64 * _KiB, dtype=np.uint8)
    names = [f"r{i}" for i in range(8)]
    with open_store(seaweedfs, s3_bucket, fault_proxy.url) as first:
        assert all(r.ok for r in first.put_many([(n, data) for n in names]))
    fault_proxy.latency = 0.01
    chance = random.Random(56)
    errors: list[str] = []
    for _ in range(12):
        store = open_store(seaweedfs, s3_bucket, fault_proxy.url, s3_num_io_threads=4)
        for n in names[::2]:  # half the items: their presigned GET fails, obstore's repeats it
            fault_proxy.fail(503, "SlowDown", times=1, methods={"GET"}, path_contains=f"{n}?X-Amz-")
        closer = threading.Timer(chance.uniform(0.0, 0.08), store.close)
        closer.start()
        try:
            for _ in range(4):
                outs = [np.zeros_like(data) for _ in names]
                for n, r, o in zip(names, store.get_many(names, outs), outs, strict=True):
                    if not (r.ok and np.array_equal(o, data)) and "closed" not in str(r.error):
                        errors.append(f"{n}: {r.error!r}")
        except Exception as e:
            if "is closed" not in str(e):  # a call that starts after close() is refused at once
                errors.append(repr(e))
        finally:
            closer.join()
            store.close()
            fault_proxy.clear()
    fault_proxy.latency = 0.0
    assert errors == []
