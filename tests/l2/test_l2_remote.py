"""The L2 adapter against a real S3-compatible server (SeaweedFS, signatures checked)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvbucket.envelope import HEADER_SIZE, MAGIC
from kvbucket.keys import ObjectKey, key_to_name
from kvbucket.l2 import open_l2_adapter
from kvbucket.testing import l2 as t
from kvbucket.testing.s3_server import S3Server

CHUNK = 64 * 1024


def k(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("meta-llama/Llama-3.1-8B", 0x01000100, i.to_bytes(16, "big"), salt)


def chunk(i: int) -> bytes:
    return bytes([i % 256]) * CHUNK


def s3_spec(server: S3Server, bucket: str, **extra: object) -> dict:
    return {"type": "s3", **server.config(bucket, prefix="kv"), "disable_tls": True, **extra}


def bucket_objects(server: S3Server, bucket: str) -> dict[str, int]:
    """Payload bytes per object, read with boto3: each object is a sealed chunk, so its raw size
    is the envelope header plus the payload (asserted here for every object)."""
    page = server.client().list_objects_v2(Bucket=bucket)
    sizes = {o["Key"]: o["Size"] for o in page.get("Contents", [])}
    for name in sizes:
        head = server.client().get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{HEADER_SIZE - 1}")
        assert head["Body"].read()[:4] == MAGIC, name
    return {n: raw - HEADER_SIZE for n, raw in sizes.items()}


def test_s3_adapter_round_trip_delete_and_restart(seaweedfs: S3Server, s3_bucket: str) -> None:
    spec = s3_spec(seaweedfs, s3_bucket, num_workers=4)
    keys = [k(i) for i in range(12)] + [k(1, "tenant-a")]
    with open_l2_adapter(spec) as a:
        res = t.store(a, keys, [chunk(i) for i in range(13)])
        assert res.success and res.bytes_stored == 13 * CHUNK
        assert t.lookup(a, [*keys, k(99)]) == [True] * 13 + [False]
        bufs = [bytearray(CHUNK) for _ in keys]
        assert t.load(a, keys, bufs) == [True] * 13
        assert all(bytes(b) == chunk(i) for i, b in enumerate(bufs))
        a.submit_unlock(keys)
        assert a.delete([k(0), k(1)]) == [True, True]
        assert a.get_usage().bytes_used == 11 * CHUNK
    # what the bucket holds, seen by another S3 client (boto3)
    objs = bucket_objects(seaweedfs, s3_bucket)
    assert len(objs) == 11 and set(objs.values()) == {CHUNK}
    assert "kv/" + key_to_name(k(1, "tenant-a")) in objs
    assert "kv/" + key_to_name(k(1)) not in objs
    # a restarted adapter knows what it holds
    with open_l2_adapter(spec) as b:
        assert b.wait_until_rebuilt(30)
        u = b.get_usage()
        assert u.bytes_used == 11 * CHUNK and dict(u.bytes_by_cache_salt) == {
            "": 10 * CHUNK,
            "tenant-a": CHUNK,
        }
        page = b.list_keys("meta-llama/Llama-3.1-8B", page_size=100)
        assert len(page.entries) == 11 and page.next_cursor is None


def test_s3_partial_batch_failure_counts_exactly_what_landed(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy
) -> None:
    spec = s3_spec(seaweedfs, s3_bucket, num_workers=1, s3_max_retries=0, s3_endpoint_url=fault_proxy.url)
    with open_l2_adapter(spec) as a:
        assert a.wait_until_rebuilt(30)
        fault_proxy.fail(503, "SlowDown", times=3, methods={"PUT"})
        keys = [k(i) for i in range(8)]
        res = t.store(a, keys, [chunk(i) for i in range(8)])
        landed = sum(res.landed)
        assert not res.success and landed == 5
        objs = bucket_objects(seaweedfs, s3_bucket)
        assert len(objs) == landed
        assert a.get_usage().bytes_used == landed * CHUNK == res.bytes_stored
        # the failed ones store fine on retry; nothing is counted twice
        assert t.store(a, keys, [chunk(i) for i in range(8)]).success
        assert a.get_usage().bytes_used == 8 * CHUNK


def test_s3_eviction_keeps_bucket_under_watermark(seaweedfs: S3Server, s3_bucket: str) -> None:
    cap_gb = 20 * CHUNK / 1024**3
    spec = s3_spec(
        seaweedfs,
        s3_bucket,
        max_capacity_gb=cap_gb,
        eviction={"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.3},
    )
    with open_l2_adapter(spec) as a:
        for i in range(40):
            t.store(a, [k(i)], [chunk(i)])
        a.delete([])
        for _ in range(300):
            if not a._evicting:
                break
            import time

            time.sleep(0.01)
        used = a.get_usage().bytes_used
        assert used < 0.8 * 20 * CHUNK
        assert sum(bucket_objects(seaweedfs, s3_bucket).values()) == used
        assert t.lookup(a, [k(39), k(0)]) == [True, False]


def test_lmcache_plugin_adapter_on_s3(seaweedfs: S3Server, s3_bucket: str) -> None:
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.api import ObjectKey as LMKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = {
        "type": "plugin",
        "module_path": "kvbucket.integrations.lmcache",
        "class_name": "KVBucketL2Adapter",
        "adapter_params": s3_spec(seaweedfs, s3_bucket),
    }
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    adapter = create_l2_adapter(cfg.adapters[0])
    try:
        keys = [LMKey(chunk_hash=bytes([i]) * 8, model_name="m", kv_rank=3) for i in range(4)]
        # temporaries on purpose: the adapter must keep the MemoryObjs alive while it reads them
        tid = adapter.submit_store_task(keys, [t.lmcache_memory_obj(chunk(i)) for i in range(4)])
        assert t.wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[tid].bytes_transferred() == 4 * CHUNK
        outs = [t.lmcache_memory_obj(bytes(CHUNK)) for _ in range(4)]
        tid = adapter.submit_load_task(keys, outs)
        assert t.wait_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(tid).popcount() == 4
        assert all(bytes(o.byte_array) == chunk(i) for i, o in enumerate(outs))
    finally:
        adapter.close()
    assert len(bucket_objects(seaweedfs, s3_bucket)) == 4
