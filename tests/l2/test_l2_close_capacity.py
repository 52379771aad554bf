"""close() right after a burst of stores leaves the bucket within its capacity (issue 40).

An outside check closed LMCache's plugin adapter right after a burst of stores larger than its
capacity: the queued stores landed during close(), but no eviction ran after them, so the bucket
stayed over its capacity until the next process stored. Run through LMCache's own
``create_l2_adapter`` (the plugin path ``lmcache server`` takes) on SeaweedFS."""

from __future__ import annotations

import argparse
import json
import logging
import time

import pytest

from kvbucket.testing import l2 as t
from kvbucket.testing.s3_server import FaultProxy, S3Server

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

CHUNK = 64 * 1024
CAPACITY_CHUNKS = 8
BURST = 40  # five times the capacity, submitted without waiting


def bucket_bytes(server: S3Server, bucket: str) -> tuple[int, int]:
    """(objects, bytes) in the bucket, seen by another S3 client (boto3)."""
    page = server.client().list_objects_v2(Bucket=bucket)
    objs = page.get("Contents", [])
    return len(objs), sum(o["Size"] for o in objs)


def test_close_right_after_a_burst_of_stores_leaves_the_bucket_within_capacity(
    seaweedfs: S3Server, s3_bucket: str
) -> None:
    from lmcache.v1.distributed.api import ObjectKey as LMKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    capacity = CAPACITY_CHUNKS * CHUNK
    spec = {
        "type": "plugin",
        "module_path": "kvbucket.integrations.lmcache",
        "class_name": "KVBucketL2Adapter",
        # a capacity and no eviction setting: kvbucket's default LRU (watermark 0.8, ratio 0.2)
        "adapter_params": {"type": "s3", **seaweedfs.config(s3_bucket, prefix="kv"), "disable_tls": True,
                           "max_capacity_gb": capacity / 1024**3, "num_workers": 2},
    }
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    adapter = create_l2_adapter(cfg.adapters[0])
    objs = [t.lmcache_memory_obj(bytes([i]) * CHUNK) for i in range(BURST)]
    for i in range(BURST):  # one task per chunk, as LMCache's store controller submits them
        adapter.submit_store_task([LMKey(chunk_hash=i.to_bytes(8, "big"), model_name="m", kv_rank=3)],
                                  [objs[i]])
    adapter.close()  # at once: most stores are still queued
    n, used = bucket_bytes(seaweedfs, s3_bucket)
    assert n > 0, "nothing landed: the test stored nothing to evict"
    assert used <= capacity, f"{n} objects, {used} bytes in a bucket of {capacity} after close()"


def test_close_whose_deadline_runs_out_leaves_the_eviction_to_the_next_adapter(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/l2.md, Close: past close's deadline the last pass is given up (a warning says how
    much is stored against the capacity); the next adapter on the prefix evicts once its usage
    rebuild is done, before any store of its own."""
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import ObjectStoreL2Adapter, open_l2_adapter, parse_l2_config
    from kvbucket.l2.registry import build_store, naming_for

    capacity = CAPACITY_CHUNKS * CHUNK
    spec = {"type": "s3", **seaweedfs.config(s3_bucket, prefix="kv", s3_endpoint_url=fault_proxy.url),
            "disable_tls": True, "max_capacity_gb": capacity / 1024**3, "num_workers": 2,
            "s3_max_retries": 0}
    keys = [ObjectKey("m", 3, i.to_bytes(8, "big"), "") for i in range(BURST)]
    a = open_l2_adapter({**spec, "eviction": {"eviction_policy": "noop"}})  # fill past the capacity
    for i in range(BURST):
        assert t.store(a, [keys[i]], [bytes([i]) * CHUNK]).success
    a.close()
    assert bucket_bytes(seaweedfs, s3_bucket)[0] == BURST
    # the spec path's close deadline is 30 s (delete_timeout_secs); a short one for the test
    fault_proxy.fail(503, "SlowDown", times=10_000, methods={"DELETE"}, delay=1.0)  # deletes hang, then fail
    b = ObjectStoreL2Adapter(build_store(parse_l2_config(spec)), max_capacity_bytes=capacity,
                             naming=naming_for(parse_l2_config(spec)), delete_timeout_secs=2.0)
    assert b.wait_until_rebuilt(30)  # then its eviction pass starts, and its deletes hang
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvbucket.l2.adapter"):
        b.close()
    took = time.monotonic() - start
    assert "eviction did not finish within the close deadline" in caplog.text, caplog.text
    assert took < 2.0 + 3.0, f"close() took {took:.1f}s with a 2 s deadline"
    assert bucket_bytes(seaweedfs, s3_bucket)[0] == BURST
    fault_proxy.clear()
    with open_l2_adapter(spec) as c:  # no store: its usage rebuild starts the pass
        assert c.wait_until_rebuilt(30)
        deadline = time.monotonic() + 60
        while (c._evicting or c.get_usage().bytes_used > 0.8 * capacity) and time.monotonic() < deadline:
            time.sleep(0.1)  # the pass's batch lands in the bucket before the index hears of it
        assert c.get_usage().bytes_used <= 0.8 * capacity
        assert bucket_bytes(seaweedfs, s3_bucket)[1] <= capacity
