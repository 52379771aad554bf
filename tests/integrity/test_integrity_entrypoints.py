"""Damaged chunks through the entry points: the L2 adapter loaded by LMCache's plugin spec, and
the transformers prefix cache (whose generation must still equal the no-cache tokens)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvbucket.envelope import HEADER_SIZE
from kvbucket.keys import key_to_name
from kvbucket.metrics import integrity_failures as failures
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.file import FileStore

DAMAGES = ("flip-payload", "flip-header", "truncate", "swap-bodies", "other-tenant")
REASON = {"flip-payload": "checksum", "flip-header": "header", "truncate": "truncated", "swap-bodies": "name",
          "other-tenant": "name"}


def damage(raw: FileStore, kind: str, a: str, b: str, foreign: str) -> list[str]:
    """Damage object ``a`` (and ``b`` for a swap) in place; the names that are now bad."""
    data = bytearray(raw.get(a) or b"")
    if kind == "flip-payload":
        data[HEADER_SIZE + 3] ^= 0x10
    elif kind == "flip-header":
        data[40] ^= 0x01  # the identity field: the header's own check catches it
    elif kind == "truncate":
        data = data[: len(data) - 100]
    elif kind == "swap-bodies":
        raw.put_many([(a, raw.get(b) or b""), (b, bytes(data))])
        return [a, b]
    else:  # another tenant's chunk under this name
        seal_store(raw, tier="writer-b").put(foreign, b"\x55" * (len(data) - HEADER_SIZE))
        data = bytearray(raw.get(foreign) or b"")
    raw.put(a, data)
    return [a]


# ---- the L2 adapter, built by LMCache from a plugin spec ----------------------------------------
@pytest.mark.lmcache
@pytest.mark.parametrize("kind", DAMAGES)
def test_l2_adapter_through_lmcache_plugin_spec(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.api import ObjectKey as LMKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from kvbucket.integrations.lmcache import to_kvbucket_key
    from kvbucket.testing.l2 import lmcache_memory_obj, wait_fd

    def lmkey(i: int, salt: str = "alice") -> LMKey:
        return LMKey(chunk_hash=i.to_bytes(16, "big"), model_name="org/llama", kv_rank=0x01000100,
                     object_group_id=0, cache_salt=salt)

    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter",
                       "adapter_params": {"type": "fs", "base_path": str(tmp_path / "kv")}})
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    adapter = create_l2_adapter(cfg.adapters[0])
    try:
        keys = [lmkey(1), lmkey(2)]
        tid = adapter.submit_store_task(keys, [lmcache_memory_obj(bytes([i]) * 4096) for i in (1, 2)])
        assert wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[tid].is_successful()
        raw = FileStore(tmp_path / "kv")
        a, b = (key_to_name(to_kvbucket_key(k)) for k in keys)
        bad = damage(raw, kind, a, b, key_to_name(to_kvbucket_key(lmkey(1, "bob"))))
        before = failures("l2", REASON[kind])
        outs = [lmcache_memory_obj(bytes(4096)) for _ in keys]
        tid = adapter.submit_load_task(keys, outs)
        assert wait_fd(adapter.get_load_event_fd())
        loaded = adapter.query_load_result(tid).get_indices_list()
        assert 0 not in loaded
        assert (1 in loaded) == (b not in bad)
        if 1 in loaded:
            assert bytes(outs[1].byte_array) == bytes([2]) * 4096
        assert failures("l2", REASON[kind]) == before + len(bad)
        # damage is removed; an intact chunk under another name is not damage and stays
        assert all(raw.exists(n) == (REASON[kind] == "name") for n in bad)
        tid = adapter.submit_lookup_and_lock_task(keys, {})  # the refused keys are forgotten
        assert wait_fd(adapter.get_lookup_and_lock_event_fd())
        assert 0 not in adapter.query_lookup_and_lock_result(tid).get_indices_list()
    finally:
        adapter.close()


@pytest.mark.lmcache
def test_l2_lookup_after_restart_does_not_count_a_truncated_object(tmp_path: Path) -> None:
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import open_l2_adapter
    from kvbucket.testing import l2 as t

    k = ObjectKey("org/llama", 0, b"\x01" * 16)
    with open_l2_adapter({"type": "fs", "base_path": str(tmp_path), "full_chunk_bytes": 4096}) as a:
        assert t.store(a, [k], [b"\x01" * 4096]).success
    path = tmp_path / key_to_name(k)
    path.write_bytes(path.read_bytes()[:3000])
    with open_l2_adapter({"type": "fs", "base_path": str(tmp_path), "full_chunk_bytes": 4096}) as a:
        assert a.wait_until_rebuilt(10)
        assert t.lookup(a, [k]) == [False]  # the listed size is not a full chunk: never a hit


# ---- the transformers prefix cache ------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("kind", DAMAGES)
def test_transformers_prefix_cache_generates_the_no_cache_tokens(tmp_path: Path, kind: str) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvbucket.backends import LocalDiskBackend
    from kvbucket.demo.model import TINY, build_model
    from kvbucket.integrations.transformers import KVBucketPrefixCache

    t = 32
    gen = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}
    model = build_model(TINY, seed=3, name="tiny-integrity")
    doc = torch.randint(0, TINY.vocab_size, (1, 4 * t + 5), generator=torch.Generator().manual_seed(1))
    ref = model.generate(doc, attention_mask=torch.ones_like(doc), **gen).sequences.tolist()
    with LocalDiskBackend(tmp_path, 1 << 28) as disk:
        with KVBucketPrefixCache(model, disk, chunk_tokens=t, tenant="team-a") as cache:
            assert cache.generate(doc, **gen).sequences.tolist() == ref
            cache.flush()
            keys = cache.chunk_keys(doc)
        raw = FileStore(tmp_path)
        names = [key_to_name(k) for k in keys]
        assert all(raw.head(n) is not None for n in names)
        before = failures("disk", REASON[kind])
        foreign = key_to_name(keys[1].with_hash(12345))
        bad = damage(raw, kind, names[1], names[2], foreign)
        with KVBucketPrefixCache(model, disk, chunk_tokens=t, tenant="team-a", store=False) as cache:
            out = cache.generate(doc, **gen)
            assert out.sequences.tolist() == ref  # exactly the tokens without a cache
            assert cache.last_stats.hit_tokens == t  # chunk 0 loaded; the prefix stops at the bad one
        assert failures("disk", REASON[kind]) == before + len(bad)  # one batched walk reads both
        assert all(raw.exists(n) == (REASON[kind] == "name") for n in bad)  # damage only is removed


# ---- the non-MP connector, loaded by LMCache's remote_storage_plugins --------------------------------
@pytest.mark.lmcache
def test_non_mp_connector_refuses_a_damaged_chunk(tmp_path: Path, lm_loop: Any) -> None:
    pytest.importorskip("lmcache")
    import time

    import torch
    from lmcache.utils import CacheEngineKey as LMKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    base = tmp_path / "remote"
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["kvbucket"],
        extra_config={
            "remote_storage_plugin.kvbucket.module_path": "kvbucket.integrations.lmcache",
            "remote_storage_plugin.kvbucket.class_name": "KVBucketConnector",
            "remote_storage_plugin.kvbucket.bucket_handle": f"file://{base}",
            "remote_storage_plugin.kvbucket.metadata_cache_ttl_secs": 0,
        },
    )
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8), chunk_size=16)
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    backend = RemoteBackend(cfg, md, lm_loop, cpu, "cpu", plugin_name="kvbucket")
    try:
        keys = [LMKey("org/llama", 1, 0, h, torch.bfloat16) for h in (0x11, 0x22)]
        objs = []
        for i, _ in enumerate(keys):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(i + 1)
            objs.append(obj)
        backend.batched_submit_put_task(keys, objs)
        names = [key_to_name(k.to_string()) for k in keys]
        raw = FileStore(base)
        deadline = time.monotonic() + 20
        while not all(raw.exists(n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)
        for obj in objs:
            obj.ref_count_down()
        damage(raw, "flip-payload", names[0], names[1], "")
        before = failures("connector", "checksum")
        assert backend.get_blocking(keys[0]) is None
        assert failures("connector", "checksum") == before + 1 and not raw.exists(names[0])
        got = backend.get_blocking(keys[1])
        assert got is not None and bytes(got.byte_array) == bytes([2]) * got.get_size()
        got.ref_count_down()
    finally:
        backend.close()
