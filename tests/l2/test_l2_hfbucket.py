"""The L2 adapter on a Hugging Face bucket (the Hub emulator, driven by unmodified huggingface_hub/hf_xet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbucket.envelope import HEADER_SIZE, MAGIC
from kvbucket.keys import ObjectKey, key_to_name
from kvbucket.l2 import open_l2_adapter
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing import l2 as t
from kvbucket.testing.hub_fixtures import HubBucket

CHUNK = 32 * 1024
SRC = str(Path(__file__).resolve().parents[2] / "src")


def k(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("Qwen/Qwen3-8B", 0x01000100, i.to_bytes(16, "big"), salt)


def chunk(i: int) -> bytes:
    return bytes([i % 256]) * (CHUNK - 8) + i.to_bytes(8, "big")


def spec(b: HubBucket, **extra: object) -> dict:
    return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint, "metadata_cache_ttl_secs": 0, **extra}  # fmt: skip


def bucket_files(b: HubBucket) -> dict[str, int]:
    """Payload bytes per object the bucket holds, read through a separate raw store (not the
    adapter): each object is a sealed chunk (asserted), its raw size the header plus the payload."""
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/{b.bucket_id}/kv", token=b.hub.write_token,
                         endpoint=b.hub.endpoint)  # fmt: skip
    with HFBucketStore(cfg) as store:
        sizes = {i.name: i.size for i in store.list()}
        for r in store.get_many(list(sizes)):
            assert bytes(memoryview(r.data)[:4]) == MAGIC, r.name
        return {n: raw - HEADER_SIZE for n, raw in sizes.items()}


def test_hfbucket_adapter_round_trip_and_restart(hub_bucket: HubBucket) -> None:
    keys = [k(i) for i in range(6)] + [k(0, "tenant-b")]
    with open_l2_adapter(spec(hub_bucket)) as a:
        assert a.wait_until_rebuilt(30)
        res = t.store(a, keys, [chunk(i) for i in range(7)])
        assert res.success and res.bytes_stored == 7 * CHUNK
        assert t.lookup(a, [*keys, k(77)]) == [True] * 7 + [False]
        bufs = [bytearray(CHUNK) for _ in keys]
        assert t.load(a, keys, bufs) == [True] * 7
        assert [bytes(b) for b in bufs] == [chunk(i) for i in range(7)]
        short = bytearray(CHUNK - 1)
        assert t.load(a, [k(1)], [short]) == [False] and short == bytearray(CHUNK - 1)
        a.submit_unlock(keys)
        assert a.delete([k(5)]) == [True]
    files = bucket_files(hub_bucket)
    assert sorted(files) == sorted(key_to_name(x) for x in keys if x != k(5))
    with open_l2_adapter(spec(hub_bucket)) as b:
        assert b.wait_until_rebuilt(30)
        u = b.get_usage()
        assert u.bytes_used == 6 * CHUNK and dict(u.bytes_by_cache_salt) == {"": 5 * CHUNK, "tenant-b": CHUNK}
        assert t.lookup(b, [k(0), k(5)]) == [True, False]


def test_hfbucket_partly_failed_batch_counts_what_landed(hub_bucket: HubBucket) -> None:
    with open_l2_adapter(spec(hub_bucket, num_workers=1, max_retries=0)) as a:
        assert a.wait_until_rebuilt(30)
        hub_bucket.hub.faults.add("batch", fail_batch_line=2, times=1)
        keys = [k(i) for i in range(4)]
        res = t.store(a, keys, [chunk(i) for i in range(4)])
        files = bucket_files(hub_bucket)
        assert not res.success
        assert sum(res.landed) == len(files) < 4
        assert a.get_usage().bytes_used == sum(files.values()) == res.bytes_stored
        hub_bucket.hub.faults.reset()
        assert t.store(a, keys, [chunk(i) for i in range(4)]).success
        assert a.get_usage().bytes_used == 4 * CHUNK == sum(bucket_files(hub_bucket).values())


@pytest.mark.slow(11)
@pytest.mark.lmcache
def test_lmcache_bench_l2_with_kvbucket_plugin_on_the_emulator(hub_bucket: HubBucket, tmp_path: Path) -> None:
    pytest.importorskip("lmcache")
    params = {"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/kv",
              "download_tmp_dir": str(tmp_path / "dl"), "num_workers": 2}  # fmt: skip
    plugin = {"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
              "class_name": "KVBucketL2Adapter", "adapter_params": params}  # fmt: skip
    out = tmp_path / "bench.json"
    hub = hub_bucket.hub
    env = {**os.environ, "PYTHONPATH": SRC, "LMCACHE_DISABLE_BANNER": "1", "HF_ENDPOINT": hub.endpoint,
           "HF_TOKEN": hub.write_token}  # fmt: skip
    cmd = [sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", json.dumps(plugin),
           "--num-keys", "4", "--data-size-kb", "32", "--rounds", "1", "--lookup-max-hit-rate", "1.0",
           "--no-skip-verify", "--format", "json", "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "All 4 keys data verified OK" in proc.stdout
    assert hub_bucket.hub.write_token not in proc.stdout + proc.stderr
    metrics = json.loads(out.read_text())["metrics"]
    ops = {m["operation"]: m for key, m in metrics.items() if key.startswith("op_")}
    assert ops["Store"]["total_success"] == 4 and ops["Load"]["total_success"] == 4
    files = bucket_files(hub_bucket)  # warmup + 1 round of 4 keys, 32 KiB each, uniform fill bytes
    assert len(files) == 8 and set(files.values()) == {32 * 1024}
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv", token=hub.write_token,
                         endpoint=hub.endpoint)  # fmt: skip
    with HFBucketStore(cfg) as raw, seal_store(raw, tier="test") as store:  # payloads, verified
        for name in files:
            data = store.get(name)
            assert data is not None and data == bytes([data[0]]) * len(data)
            assert name.startswith("bench-model@")


@pytest.mark.lmcache
def test_connector_on_a_bucket_through_lmcache_remote_backend(hub_bucket: HubBucket) -> None:
    pytest.importorskip("lmcache")
    import asyncio
    import threading
    import time

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    pre = "remote_storage_plugin.hf.eu."
    hub = hub_bucket.hub
    extra = {
        pre + "module_path": "kvbucket.integrations.lmcache",
        pre + "class_name": "KVBucketConnector",
        pre + "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/kv",
        pre + "token": hub.write_token,
        pre + "endpoint": hub.endpoint,
        pre + "metadata_cache_ttl_secs": 0,
    }
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["hf.eu"], extra_config=extra,
    )  # fmt: skip
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8),
                         chunk_size=16)  # fmt: skip
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    backend = RemoteBackend(cfg, md, loop, cpu, "cpu", plugin_name="hf.eu")
    try:
        keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in (0x51, 0x52)]
        objs = []
        for i, _ in enumerate(keys):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(0x40 + i)
            objs.append(obj)
        backend.batched_submit_put_task(keys, objs)
        deadline = time.monotonic() + 30
        while backend.batched_contains(keys) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.batched_contains(keys) == 2
        got = backend.get_blocking(keys[1])
        assert got is not None and bytes(got.byte_array) == bytes([0x41]) * got.get_size()
        got.ref_count_down()
        for obj in objs:
            obj.ref_count_down()
        assert sorted(bucket_files(hub_bucket)) == sorted(key_to_name(k.to_string()) for k in keys)
    finally:
        backend.close()
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
        loop.close()
