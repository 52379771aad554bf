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
