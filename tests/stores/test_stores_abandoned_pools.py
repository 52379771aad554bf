"""A store's pool replaced at one call's deadline takes nothing from the other calls.

A store replaces its worker pool when a call's deadline passes with workers stuck in calls that
cannot be cancelled (hf_xet streams, obstore requests). The old pool used to be shut with its
queue cancelled: work other loads had queued there failed long before their own deadlines (an
outside tester: loads failing at 1.4 s of a 3 s budget with "was closed during this call"), a
load submitting meanwhile was refused, and the Hub store then returned that load while fetches
it had already submitted still wrote into the caller's buffers (seen as buffers changing after
``get_many`` returned). Now the queued work moves to the new pool (``DaemonThreadPool.hand_over``)
and a refused submit follows the store to its new pool (``threads.submit_current``).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest

from kvbucket.errors import DeadlineExceededError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.threads import DaemonThreadPool, submit_current


def test_hand_over_moves_queued_work_to_the_new_pool_and_cancels_none() -> None:
    old, new = DaemonThreadPool(1, "kvbucket-test-old"), DaemonThreadPool(2, "kvbucket-test-new")
    release = threading.Event()
    try:
        stuck = old.submit(release.wait, 10)
        while not stuck.running():
            time.sleep(0.01)
        queued = [old.submit(pow, 2, i) for i in range(4)]
        assert old.hand_over(new) == 4
        assert [f.result(timeout=5) for f in queued] == [1, 2, 4, 8]  # run by the new pool's workers
        assert not any(f.cancelled() for f in queued)
        with pytest.raises(RuntimeError, match="after shutdown"):
            old.submit(print)
        release.set()
        assert stuck.result(timeout=5) is True  # the stuck call ends on its own worker
    finally:
        release.set()
        new.shutdown()


def test_a_refused_submit_follows_the_store_to_its_new_pool() -> None:
    holder = {"pool": DaemonThreadPool(1, "kvbucket-test-a")}
    refused = holder["pool"]
    holder["pool"] = DaemonThreadPool(1, "kvbucket-test-b")
    refused.hand_over(holder["pool"])
    seen = iter([refused, holder["pool"]])  # the caller read the old pool before the swap
    fut: Future[int] = submit_current(lambda: next(seen), lambda: False, pow, 3, 2)
    assert fut.result(timeout=5) == 9
    with pytest.raises(RuntimeError):  # no new pool came: the refusal is raised, not looped on
        submit_current(lambda: refused, lambda: False, pow, 3, 2)
    with pytest.raises(RuntimeError):  # closed: raised at once
        submit_current(lambda: refused, lambda: True, pow, 3, 2)
    holder["pool"].shutdown()


def test_a_hub_load_queued_behind_a_stuck_one_survives_its_abandonment(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    store = HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/pool-{uuid.uuid4().hex[:6]}",
        token=hub.write_token, token_env="", endpoint=hub.endpoint, load_concurrency=1, load_timeout_secs=2.0,
        breaker_failures=0))
    release = threading.Event()
    try:
        a, b = bytes(range(256)) * 4096, bytes(range(255, -1, -1)) * 4096
        assert all(r.ok for r in store.put_many([("a", a), ("b", b)]))
        real = store._download

        def download(name: str, *args: Any) -> Any:  # a's read is stuck where nothing can cancel it
            if name == "a":
                release.wait(10)
            return real(name, *args)

        store._download = download  # type: ignore[method-assign]
        buf_a = bytearray(b"\xee" * len(a))
        got: dict[str, Any] = {}
        ta = threading.Thread(target=lambda: got.update(a=store.get_many(["a"], [buf_a])))
        ta.start()
        time.sleep(1.0)  # b's fetch queues behind a's on the one load worker
        t0 = time.monotonic()
        (rb,) = store.get_many(["b"])
        took_b = time.monotonic() - t0
        ta.join(10)
        (ra,) = got["a"]
        assert isinstance(ra.error, DeadlineExceededError)  # a is late at its own deadline
        assert rb.ok and bytes(rb.data) == b, (rb, took_b)  # b was not failed by a's abandonment
        release.set()  # a's abandoned read goes on now: its gate is closed, it writes nothing
        time.sleep(0.5)
        assert buf_a == b"\xee" * len(a)
    finally:
        release.set()
        store.close()


def test_an_s3_call_queued_behind_a_stuck_one_survives_its_abandonment(seaweedfs: Any,
                                                                        s3_bucket: str) -> None:
    store = S3Store(S3Config.parse(seaweedfs.config(s3_bucket, s3_num_io_threads=1)))
    release = threading.Event()
    try:
        stuck: list[BaseException] = []

        def first() -> None:
            try:
                store._bounded(lambda: release.wait(10), time.monotonic() + 1.0)
            except BaseException as e:
                stuck.append(e)

        t = threading.Thread(target=first)
        t.start()
        time.sleep(0.3)  # the second call queues behind the stuck one on the one worker
        assert store._bounded(lambda: "second", time.monotonic() + 5.0) == "second"
        t.join(10)
        assert len(stuck) == 1 and type(stuck[0]).__name__ == "TimeoutError", stuck
    finally:
        release.set()
        store.close()
