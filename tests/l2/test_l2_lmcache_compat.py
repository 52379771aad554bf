"""One bucket, LMCache 0.5.6's built-in adapters and kvbucket, both directions.

LMCache's own code writes N chunks and kvbucket (default settings: only the adapter type
swapped) reads all N; kvbucket with ``object_format: "lmcache"`` writes N chunks and LMCache's
own code reads all N. For ``hfbucket`` (MP adapter and non-MP connector, on the Hub emulator,
LMCache driving unmodified huggingface_hub) and ``s3`` (MP adapter and non-MP connector, on
SeaweedFS, LMCache driving awscrt). LMCache's s3 code only speaks virtual-hosted requests to
the host in its endpoint, so SeaweedFS here also serves the domain ``0.0.1``: Host
``127.0.0.1:<port>`` is bucket ``127``, no DNS needed (as benchmarks/bench_l2.py does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.memory_management import MemoryFormat

from kvbucket.integrations.lmcache import KVBucketConnector, KVBucketL2Adapter
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.l2 import drain_fd, lmcache_memory_obj, wait_fd
from kvbucket.testing.s3_server import DOMAIN, S3Server, SeaweedFS

pytestmark = pytest.mark.lmcache

N = 6
CHUNK = 4096


def lmkeys(model: str) -> list[LMKey]:
    keys = [LMKey(chunk_hash=i.to_bytes(4, "big"), model_name=model, kv_rank=0, object_group_id=0,
                  cache_salt="") for i in range(1, N - 1)]  # fmt: skip
    keys.append(LMKey(chunk_hash=b"\xaa" * 16, model_name=model, kv_rank=0x01000100, object_group_id=0,
                      cache_salt="alice"))  # fmt: skip
    keys.append(LMKey(chunk_hash=b"\xbb" * 16, model_name=model, kv_rank=0x02010200, object_group_id=1,
                      cache_salt=""))  # fmt: skip
    return keys


def payload(i: int) -> bytes:
    return bytes([i + 1]) * (CHUNK - 4) + i.to_bytes(4, "big")


# ---- driving an MP adapter (LMCache's or kvbucket's) -----------------------------------------
def mp_store(adapter: Any, keys: list[LMKey]) -> None:
    tid = adapter.submit_store_task(keys, [lmcache_memory_obj(payload(i)) for i in range(len(keys))])
    assert wait_fd(adapter.get_store_event_fd())
    drain_fd(adapter.get_store_event_fd())
    assert adapter.pop_completed_store_tasks()[tid].is_successful()


def mp_read_all(adapter: Any, keys: list[LMKey]) -> tuple[list[int], list[int]]:
    """(lookup hits, loads with the right bytes), as indices."""
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    assert wait_fd(adapter.get_lookup_and_lock_event_fd())
    drain_fd(adapter.get_lookup_and_lock_event_fd())
    hits = adapter.query_lookup_and_lock_result(tid).get_indices_list()
    outs = [lmcache_memory_obj(bytes(CHUNK)) for _ in keys]
    tid = adapter.submit_load_task(keys, outs)
    assert wait_fd(adapter.get_load_event_fd())
    drain_fd(adapter.get_load_event_fd())
    loaded = adapter.query_load_result(tid).get_indices_list()
    adapter.submit_unlock(keys)
    return hits, [i for i in loaded if bytes(outs[i].byte_array) == payload(i)]


ALL = list(range(N))


# ---- hfbucket -----------------------------------------------------------------------------------
def lm_hf_client(b: HubBucket) -> Any:
    """LMCache's own bucket client (unmodified huggingface_hub) pointed at the emulator."""
    from huggingface_hub import HfApi
    from lmcache.v1.storage_backend.connector.hfbucket_connector import HFBucketClient

    client = HFBucketClient(token=b.hub.write_token)
    client._api = HfApi(endpoint=b.hub.endpoint, token=b.hub.write_token)
    return client


def hf_params(b: HubBucket, **extra: Any) -> dict[str, Any]:
    return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint, "metadata_cache_ttl_secs": 0, **extra}  # fmt: skip


def bucket_names(b: HubBucket) -> set[str]:
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/{b.bucket_id}", token=b.hub.write_token,
                         endpoint=b.hub.endpoint)  # fmt: skip
    with HFBucketStore(cfg) as store:
        return {i.name for i in store.list()}


def lm_hf_adapter(b: HubBucket, tmp_path: Path) -> Any:
    from lmcache.v1.distributed.l2_adapters.hfbucket_l2_adapter import (
        HFBucketL2Adapter,
        HFBucketL2AdapterConfig,
    )

    cfg = HFBucketL2AdapterConfig(bucket_handle=f"hf://buckets/{b.bucket_id}/kv", metadata_cache_ttl_secs=0,
                                  download_tmp_dir=str(tmp_path / "lm-dl"))  # fmt: skip
    return HFBucketL2Adapter(cfg, bucket_client=lm_hf_client(b))


def test_mp_hfbucket_lmcache_writes_kvbucket_reads(hub_bucket: HubBucket, tmp_path: Path) -> None:
    keys = lmkeys("test/model")
    lm = lm_hf_adapter(hub_bucket, tmp_path)
    try:
        mp_store(lm, keys)
    finally:
        lm.close()
    # the documented name of model test/model, rank 0, group 0, hash 00000001
    assert "kv/test%2Fmodel%4000000000%400%4000000001" in bucket_names(hub_bucket)
    kv = KVBucketL2Adapter(hf_params(hub_bucket))  # only the adapter type swapped
    try:
        assert mp_read_all(kv, keys) == (ALL, ALL)
        assert kv.get_usage().total_bytes_used == N * CHUNK  # found by the startup listing
        # kvbucket's own (sealed) writes never sit under LMCache's names: LMCache misses them
        mp_store(kv, [lmkeys("other/model")[0]])
    finally:
        kv.close()
    lm = lm_hf_adapter(hub_bucket, tmp_path)
    try:
        assert mp_read_all(lm, [lmkeys("other/model")[0]]) == ([], [])
    finally:
        lm.close()


def test_mp_hfbucket_kvbucket_lmcache_format_lmcache_reads(hub_bucket: HubBucket, tmp_path: Path) -> None:
    keys = lmkeys("test/model")
    kv = KVBucketL2Adapter(hf_params(hub_bucket, object_format="lmcache"))
    try:
        mp_store(kv, keys)
    finally:
        kv.close()
    names = bucket_names(hub_bucket)
    assert len(names) == N and "kv/test%2Fmodel%4000000000%400%4000000001" in names
    lm = lm_hf_adapter(hub_bucket, tmp_path)
    try:
        assert mp_read_all(lm, keys) == (ALL, ALL)
    finally:
        lm.close()


# ---- non-MP connectors ------------------------------------------------------------------------------
def engine(extra: dict[str, Any]) -> tuple[Any, Any, Any]:
    """An LMCache engine config, metadata and CPU backend; full chunk 16 KiB (a multiple of the
    allocator's 4 KiB alignment: LMCache's connectors compare the padded size)."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=False, max_local_cpu_size=0.05,
                                            save_unfull_chunk=False, remote_serde="naive",
                                            remote_storage_plugins=["kv"], extra_config=extra)  # fmt: skip
    md = LMCacheMetadata(model_name="test/model", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 64),
                         chunk_size=16)  # fmt: skip
    return cfg, md, LocalCPUBackend(cfg, md, dst_device="cpu")


def ce_keys(model: str = "test/model") -> list[CacheEngineKey]:
    return [CacheEngineKey(model, 1, 0, h, torch.bfloat16) for h in (0x1E, -0x77, *range(100, 100 + N - 2))]


def filled(cpu: Any, md: Any, i: int) -> Any:
    obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
    obj.raw_data.view(torch.uint8).fill_(i + 1)
    return obj


def kv_connector(loop: Any, extra: dict[str, Any]) -> KVBucketConnector:
    pre = "remote_storage_plugin.kv."
    cfg, _, cpu = engine({pre + "module_path": "kvbucket.integrations.lmcache",
                          pre + "class_name": "KVBucketConnector",
                          **{pre + k: v for k, v in extra.items()}})  # fmt: skip
    return KVBucketConnector(loop=loop, local_cpu_backend=cpu, config=cfg)


def conn_put(conn: Any, loop: Any, keys: list[CacheEngineKey]) -> None:
    md = conn.local_cpu_backend.metadata
    objs = [filled(conn.local_cpu_backend, md, i) for i in range(len(keys))]
    for k, o in zip(keys, objs, strict=True):
        asyncio.run_coroutine_threadsafe(conn.put(k, o), loop).result(30)


def conn_read_all(conn: Any, loop: Any, keys: list[CacheEngineKey]) -> tuple[int, list[int]]:
    """(prefix hits by batched contains, keys loaded with the right bytes)."""
    hits = asyncio.run_coroutine_threadsafe(conn.batched_async_contains("t", keys), loop).result(30)
    got = asyncio.run_coroutine_threadsafe(conn.batched_get(keys), loop).result(30)
    good = [i for i, o in enumerate(got)
            if o is not None and bytes(o.byte_array) == bytes([i + 1]) * o.get_size()]  # fmt: skip
    return hits, good


def lm_hf_connector(b: HubBucket, tmp_path: Path) -> Any:
    from lmcache.v1.storage_backend.connector.hfbucket_connector import (
        HFBucketConnector,
        HFBucketConnectorConfig,
        parse_hfbucket_handle,
    )

    cfg, md, cpu = engine({})
    where = parse_hfbucket_handle(f"hf://buckets/{b.bucket_id}/kv")
    ccfg = HFBucketConnectorConfig(plugin_name="hfbucket", bucket_location=where, token_env="",
                                   token=b.hub.write_token, create_bucket_if_missing=False,
                                   download_tmp_dir=tmp_path / "lm-dl",
                                   metadata_cache_ttl_secs=0)  # fmt: skip
    return HFBucketConnector(cpu, cfg, md, ccfg, bucket_client=lm_hf_client(b))


def hf_conn_extra(b: HubBucket, **extra: Any) -> dict[str, Any]:
    return {"bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint, "metadata_cache_ttl_secs": 0, **extra}  # fmt: skip


def test_nonmp_hfbucket_both_directions(hub_bucket: HubBucket, tmp_path: Path, lm_loop: Any) -> None:
    keys = ce_keys()
    lm = lm_hf_connector(hub_bucket, tmp_path)
    conn_put(lm, lm_loop, keys)
    assert "kv/test%2Fmodel%401%400%401e%40bfloat16" in bucket_names(hub_bucket)
    kv = kv_connector(lm_loop, hf_conn_extra(hub_bucket))
    assert conn_read_all(kv, lm_loop, keys) == (N, ALL)
    assert sorted(asyncio.run_coroutine_threadsafe(kv.list(), lm_loop).result(30)) == sorted(
        k.to_string() for k in keys
    )
    # the reverse, on other keys
    other = ce_keys("other/model")
    kv_lm = kv_connector(lm_loop, hf_conn_extra(hub_bucket, object_format="lmcache"))
    conn_put(kv_lm, lm_loop, other)
    assert "kv/other%2Fmodel%401%400%401e%40bfloat16" in bucket_names(hub_bucket)
    assert conn_read_all(lm, lm_loop, other) == (N, ALL)
    for c in (lm, kv, kv_lm):
        asyncio.run_coroutine_threadsafe(c.close(), lm_loop).result(30)


# ---- s3 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vhost_s3() -> Iterator[S3Server]:
    """SeaweedFS also serving domain ``0.0.1``: Host ``127.0.0.1:<port>`` is bucket ``127``."""
    weed = SeaweedFS(domain_name=f"{DOMAIN},0.0.1", client_host="localhost")
    server = weed.start()
    try:
        server.create_bucket("127")
        yield server
    finally:
        weed.stop()


def s3_params(s: S3Server, **extra: Any) -> dict[str, Any]:
    return {"type": "s3", "s3_endpoint": f"127.0.0.1:{s.port}", "s3_region": s.region, "disable_tls": True,
            "aws_access_key_id": s.access_key, "aws_secret_access_key": s.secret_key,
            "metadata_cache_ttl_secs": 0, **extra}  # fmt: skip


def lm_s3_adapter(s: S3Server) -> Any:
    from lmcache.v1.distributed.l2_adapters.s3_l2_adapter import S3L2Adapter, S3L2AdapterConfig

    return S3L2Adapter(S3L2AdapterConfig(s3_endpoint=f"127.0.0.1:{s.port}", s3_region=s.region,
                                         s3_num_io_threads=2, s3_prefer_http2=False, disable_tls=True,
                                         aws_access_key_id=s.access_key,
                                         aws_secret_access_key=s.secret_key))  # fmt: skip


def s3_names(s: S3Server) -> set[str]:
    pages = s.client().get_paginator("list_objects_v2").paginate(Bucket="127")
    return {o["Key"] for p in pages for o in p.get("Contents", [])}


def test_mp_s3_both_directions(vhost_s3: S3Server) -> None:
    keys = lmkeys("mp-fwd/model")
    lm = lm_s3_adapter(vhost_s3)
    try:
        mp_store(lm, keys)
    finally:
        lm.close()
    assert "mp-fwd/model@00000000@0@00000001" in s3_names(vhost_s3)
    kv = KVBucketL2Adapter(s3_params(vhost_s3))
    try:
        assert mp_read_all(kv, keys) == (ALL, ALL)
    finally:
        kv.close()
    back = lmkeys("mp-back/model")
    kv = KVBucketL2Adapter(s3_params(vhost_s3, object_format="lmcache"))
    try:
        mp_store(kv, back)
    finally:
        kv.close()
    assert "mp-back/model@00000000@0@00000001" in s3_names(vhost_s3)
    lm = lm_s3_adapter(vhost_s3)
    try:
        assert mp_read_all(lm, back) == (ALL, ALL)
    finally:
        lm.close()


def lm_s3_connector(s: S3Server, loop: Any) -> Any:
    from lmcache.v1.storage_backend.connector.s3_connector import S3Connector

    _, _, cpu = engine({"s3_region": s.region})
    return S3Connector(s3_endpoint=f"s3://127.0.0.1:{s.port}", loop=loop, local_cpu_backend=cpu,
                       s3_num_io_threads=2, s3_prefer_http2=False, s3_region=s.region,
                       s3_enable_s3express=False, disable_tls=True, aws_access_key_id=s.access_key,
                       aws_secret_access_key=s.secret_key)  # fmt: skip


def s3_conn_extra(s: S3Server, **extra: Any) -> dict[str, Any]:
    p = s3_params(s, **extra)
    p.pop("type")
    p["bucket_handle"] = "s3://" + p.pop("s3_endpoint")
    return p


def test_nonmp_s3_both_directions(vhost_s3: S3Server, lm_loop: Any) -> None:
    keys = ce_keys("nonmp-fwd/model")
    lm = lm_s3_connector(vhost_s3, lm_loop)
    conn_put(lm, lm_loop, keys)
    assert "nonmp-fwd_model@1@0@1e@bfloat16" in s3_names(vhost_s3)
    kv = kv_connector(lm_loop, s3_conn_extra(vhost_s3))
    assert conn_read_all(kv, lm_loop, keys) == (N, ALL)
    back = ce_keys("nonmp-back/model")
    kv_lm = kv_connector(lm_loop, s3_conn_extra(vhost_s3, object_format="lmcache"))
    conn_put(kv_lm, lm_loop, back)
    assert "nonmp-back_model@1@0@1e@bfloat16" in s3_names(vhost_s3)
    assert conn_read_all(lm, lm_loop, back) == (N, ALL)
    # not LMCache's S3Connector: its close() waits on its executor from the loop it runs on
    for c in (kv, kv_lm):
        asyncio.run_coroutine_threadsafe(c.close(), lm_loop).result(30)
