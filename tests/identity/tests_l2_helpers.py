"""LMCache's MP L2 adapter built by LMCache's own factory, storing and reading five chunks (as
tests/l2/test_l2_identity.py does), for the identity tests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from kvbucket.testing.l2 import drain_fd, lmcache_memory_obj, wait_fd

N, CHUNK, MODEL = 5, 4096, "org/llama"


def mp_adapter(root: Path, **params: Any) -> Any:
    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter",
                       "adapter_params": {"type": "fs", "base_path": str(root), **params}})
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return create_l2_adapter(cfg.adapters[0])


def payload(i: int) -> bytes:
    return bytes([i + 7]) * (CHUNK - 4) + i.to_bytes(4, "big")


def lmkeys() -> list[LMKey]:
    return [LMKey(chunk_hash=(i + 1).to_bytes(16, "big"), model_name=MODEL, kv_rank=0x01000100,
                  object_group_id=0, cache_salt="") for i in range(N)]  # fmt: skip


def mp_store_result(adapter: Any) -> bool:
    tid = adapter.submit_store_task(lmkeys(), [lmcache_memory_obj(payload(i)) for i in range(N)])
    assert wait_fd(adapter.get_store_event_fd())
    drain_fd(adapter.get_store_event_fd())
    return bool(adapter.pop_completed_store_tasks()[tid].is_successful())


def mp_read(adapter: Any) -> tuple[list[int], list[int]]:
    keys = lmkeys()
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


# ---- non-MP: LMCache's engine config, metadata and CPU backend ---------------------------------
def connector(loop: Any, root: Path, **extra: Any) -> Any:
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvbucket.integrations.lmcache import KVBucketConnector

    pre = "remote_storage_plugin.kv."
    conf = {pre + "module_path": "kvbucket.integrations.lmcache", pre + "class_name": "KVBucketConnector",
            pre + "bucket_handle": f"file://{root}", pre + "metadata_cache_ttl_secs": 0,
            **{pre + k: v for k, v in extra.items()}}
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=False, max_local_cpu_size=0.05,
                                            save_unfull_chunk=False, remote_serde="naive",
                                            remote_storage_plugins=["kv"], extra_config=conf)  # fmt: skip
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 64),
                         chunk_size=16)  # fmt: skip
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    return KVBucketConnector(loop=loop, local_cpu_backend=cpu, config=cfg)


def run(loop: Any, coro: Any) -> Any:
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def ce_keys() -> list[Any]:
    import torch
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey(MODEL, 1, 0, h, torch.bfloat16) for h in range(0x100, 0x100 + N)]


def conn_put(conn: Any, loop: Any) -> None:
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    cpu, md = conn.local_cpu_backend, conn.local_cpu_backend.metadata
    for i, k in enumerate(ce_keys()):
        obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
        obj.raw_data.view(torch.uint8).fill_(i + 1)
        run(loop, conn.put(k, obj))


def conn_read(conn: Any, loop: Any) -> tuple[int, list[int]]:
    keys = ce_keys()
    hits = run(loop, conn.batched_async_contains("t", keys))
    got = run(loop, conn.batched_get(keys))
    return hits, [i for i, o in enumerate(got)
                  if o is not None and bytes(o.byte_array) == bytes([i + 1]) * o.get_size()]  # fmt: skip
