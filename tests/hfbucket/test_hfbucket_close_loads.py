"""A Hub store closed while loads are in flight ends them at once (outside tester, issue 41 area).

Before: every load in flight or queued at close() returned only at its load deadline (5.04 s
by default, 30 s with load_timeout_secs=30) with DeadlineExceededError, where an S3 store's
loads end within 0.15 s saying the store "was closed during this call". Here, on the Hub
emulator with the unmodified huggingface_hub/hf_xet: every call returns within a bound, each
item is read whole or says it was closed, no get_many raises, and no buffer is written after
its call returned (filled with a sentinel, checked again after a sleep).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

from kvbucket.errors import StoreError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore

MiB = 1 << 20
CLOSED = "was closed during this call"
RETURN_BOUND_SECS = 1.0  # measured 0.05-0.2 s on a shared 2-core machine; was 5-30 s
SENTINEL = 0xA5


def _store(hub_bucket: Any, **options: Any) -> HFBucketStore:
    hub = hub_bucket.hub
    opts: dict[str, Any] = {"token": hub.write_token, "token_env": "", "endpoint": hub.endpoint,
                            "retry_backoff_secs": 0.01, "load_timeout_secs": 30, "lookup_timeout_secs": 10,
                            "read_part_bytes": 512 << 10, **options}
    return HFBucketStore(build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/cl", **opts))


def _put(hub_bucket: Any, size: int, n: int) -> dict[str, bytes]:
    objs = {f"o{i}": os.urandom(size) for i in range(n)}
    writer = _store(hub_bucket)
    try:
        assert all(r.ok for r in writer.put_many(list(objs.items())))
    finally:
        writer.close()
    return objs


def test_close_ends_a_slow_load_and_its_queued_neighbours_at_once(hub_bucket: Any, hub_faults: Any) -> None:
    """Two objects mid-fetch (the storage answers after 3 s) and two queued behind them
    (load_concurrency=2): close() after 0.5 s ends all four at once, and the fetches that
    answer later write nothing into the caller's buffers."""
    objs = _put(hub_bucket, 1 * MiB, 4)
    store = _store(hub_bucket, load_concurrency=2, breaker_failures=0)
    names = sorted(objs)
    hub_faults.add("fetch", latency_s=3.0)
    bufs = [bytearray([SENTINEL]) * MiB for _ in names]
    got: list[Any] = []

    def load() -> None:
        try:
            got.append(store.get_many(names, bufs))
        except Exception as e:  # a load in flight never raises: the test says so below
            got.append(e)
        got.append(time.monotonic())

    t = threading.Thread(target=load)
    t.start()
    time.sleep(0.5)
    closed_at = time.monotonic()
    store.close()
    t.join(10)
    assert not t.is_alive(), "get_many did not return after close()"
    results, returned = got
    assert isinstance(results, list), f"get_many raised: {results!r}"
    assert returned - closed_at < RETURN_BOUND_SECS, f"returned {returned - closed_at:.2f}s after close()"
    assert [r.error is not None and CLOSED in str(r.error) for r in results] == [True] * 4, results
    assert isinstance(results[0].error, StoreError) and hub_bucket.bucket_id in str(results[0].error)
    time.sleep(3.5)  # the delayed fetches have answered meanwhile: nothing of them may land
    assert all(b == bytearray([SENTINEL]) * MiB for b in bufs), "a buffer was written after get_many returned"


def _race(store: HFBucketStore, objs: dict[str, bytes], after_secs: float, outcomes: Counter[str]
          ) -> tuple[list[float], list[str], int]:
    """8 threads load every object in a loop until ``store`` is closed under them, after
    ``after_secs``: how long after close() each call in flight returned, what went wrong, and how
    many threads hung."""
    names = sorted(objs)
    closing = threading.Event()
    closed_at = [0.0]
    returns: list[float] = []
    problems: list[str] = []

    def worker(seed: int) -> None:
        while True:
            keys = names[seed % 8:] + names[:seed % 8]
            bufs = [bytearray([SENTINEL]) * len(objs[k]) for k in keys]
            began_after_close = closing.is_set()
            try:
                res = store.get_many(keys, bufs)
            except StoreError as e:  # only a call begun once close() had begun may raise
                if not (began_after_close and "is closed" in str(e)):
                    problems.append(f"get_many raised {e!r}")
                return
            except Exception as e:
                problems.append(f"get_many raised {e!r}")
                return
            now = time.monotonic()
            snap = [bytes(b) for b in bufs]
            for k, b, r in zip(keys, bufs, res, strict=True):
                if r.ok and bytes(b) == objs[k]:
                    outcomes["ok"] += 1
                elif r.error is not None and CLOSED in str(r.error):
                    outcomes["closed"] += 1
                else:
                    problems.append(f"{k}: {r.error!r} (ok={r.ok})")
            if closing.is_set():
                returns.append(now - closed_at[0])
                time.sleep(0.3)
                late = sum(s != bytes(b) for s, b in zip(snap, bufs, strict=True))
                if late:
                    problems.append(f"{late} buffers written after get_many returned")
                return
            seed += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    time.sleep(after_secs)
    closed_at[0] = time.monotonic()
    closing.set()
    store.close()
    for th in threads:
        th.join(40)
    return returns, problems, sum(th.is_alive() for th in threads)


def test_threads_loading_while_the_store_closes_get_whole_objects_or_closed(hub_bucket: Any) -> None:
    """The outside tester's race: 8 threads load 8 x 2 MiB (read in 512 KiB parts) in a loop from
    one store, which is closed under them, three rounds."""
    objs = _put(hub_bucket, 2 * MiB, 8)
    outcomes: Counter[str] = Counter()
    for rnd in range(3):
        returns, problems, hung = _race(_store(hub_bucket), objs, 1.0 + 0.3 * rnd, outcomes)
        assert not hung, f"round {rnd}: {hung} loads hung"
        assert not problems, f"round {rnd}: {problems[:5]}"
        assert max(returns, default=0.0) < RETURN_BOUND_SECS, f"round {rnd}: calls returned {sorted(returns)}"
    assert outcomes["ok"] > 0 and outcomes["closed"] > 0, outcomes  # both paths ran


def test_close_during_a_loads_lookup_ends_it_with_the_lookup(hub_bucket: Any, hub_faults: Any) -> None:
    """The lookup part of a load (paths-info, answered after 1.5 s here) is not cut short by
    close(): the load ends when it answers, sending no fetch, its items closed, nothing raised."""
    objs = _put(hub_bucket, 256 << 10, 2)
    store = _store(hub_bucket, breaker_failures=0)
    hub_faults.add("paths_info", latency_s=1.5)
    bufs = [bytearray([SENTINEL]) * (256 << 10) for _ in objs]
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(store.get_many(sorted(objs), bufs)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    store.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 1.5 + RETURN_BOUND_SECS
    (results,) = got
    assert [r.error is not None and CLOSED in str(r.error) for r in results] == [True, True], results
    time.sleep(0.3)
    assert all(b == bytearray([SENTINEL]) * (256 << 10) for b in bufs)
