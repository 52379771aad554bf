"""kvbucket inside the real lmcache 0.5.6: the MP plugin L2 adapter and the non-MP connector."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat

from kvbucket.integrations.lmcache import KVBucketL2Adapter, to_kvbucket_key, to_lmcache_key
from kvbucket.keys import key_to_name
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.l2 import lmcache_memory_obj, wait_fd

pytestmark = pytest.mark.lmcache



def plugin_spec(params: dict) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvbucket.integrations.lmcache",
            "class_name": "KVBucketL2Adapter",
            "adapter_params": params,
        }
    )


def lmkey(i: int, salt: str = "", group: int = 0) -> LMKey:
    return LMKey(
        chunk_hash=i.to_bytes(16, "big"),
        model_name="org/llama",
        kv_rank=0x01000100,
        object_group_id=group,
        cache_salt=salt,
    )


def test_lmcache_factory_builds_plugin_and_interface_round_trips(tmp_path: Path) -> None:
    import argparse

    ns = argparse.Namespace(
        l2_adapter=[plugin_spec({"type": "fs", "base_path": str(tmp_path / "kv"), "max_capacity_gb": 1.0})]
    )
    cfg = parse_args_to_l2_adapters_config(ns)
    adapter = create_l2_adapter(cfg.adapters[0])
    try:
        assert isinstance(adapter, KVBucketL2Adapter)
        events: list[str] = []

        class Listener:
            def on_l2_keys_stored(self, keys, sizes):
                events.append(f"stored:{len(keys)}:{sum(sizes)}")

            def on_l2_keys_accessed(self, keys):
                events.append(f"accessed:{len(keys)}")

            def on_l2_keys_deleted(self, keys):
                events.append(f"deleted:{len(keys)}")

        adapter.register_listener(Listener())
        keys = [lmkey(1), lmkey(2, "alice"), lmkey(3, group=2)]
        objs = [lmcache_memory_obj(bytes([i]) * 2048) for i in (1, 2, 3)]
        tid = adapter.submit_store_task(keys, objs)
        assert wait_fd(adapter.get_store_event_fd())
        res = adapter.pop_completed_store_tasks()[tid]
        assert res.is_successful() and res.bytes_transferred() == 3 * 2048
        usage = adapter.get_usage()
        assert usage.total_bytes_used == 3 * 2048 and usage.total_capacity_bytes == 1024**3
        assert dict(usage.bytes_by_cache_salt) == {"": 2 * 2048, "alice": 2048}

        tid = adapter.submit_lookup_and_lock_task([*keys, lmkey(9)], {})
        assert wait_fd(adapter.get_lookup_and_lock_event_fd())
        bm = adapter.query_lookup_and_lock_result(tid)
        assert bm.get_indices_list() == [0, 1, 2] and adapter.query_lookup_and_lock_result(tid) is None

        outs = [lmcache_memory_obj(bytes(2048)) for _ in range(3)]
        tid = adapter.submit_load_task(keys, outs)
        assert wait_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(tid).popcount() == 3
        assert [bytes(o.byte_array) for o in outs] == [bytes([i]) * 2048 for i in (1, 2, 3)]

        adapter.delete([keys[0]])  # locked by the lookup: skipped
        assert adapter.get_usage().total_bytes_used == 3 * 2048
        adapter.submit_unlock([keys[0]])
        adapter.delete([keys[0]])
        assert adapter.get_usage().total_bytes_used == 2 * 2048
        assert events == ["stored:3:6144", "accessed:3", "deleted:1"]

        page = adapter.list_l2_keys("org/llama", page_size=1)
        assert len(page.entries) == 1 and page.next_page_token is not None
        page2 = adapter.list_l2_keys("org/llama", page_size=10, cursor=page.next_page_token)
        assert len(page.entries) + len(page2.entries) == 2 and page2.next_page_token is None
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()
    # after close: submits complete at once as failed
    tid = adapter.submit_store_task([lmkey(5)], [lmcache_memory_obj(bytes(2048))])
    assert not adapter.pop_completed_store_tasks()[tid].is_successful()


def test_object_group_is_folded_reversibly_and_group0_gets_the_documented_name() -> None:
    k0, k2 = lmkey(7), lmkey(7, "t", group=2)
    assert to_lmcache_key(to_kvbucket_key(k0)) == k0 and to_lmcache_key(to_kvbucket_key(k2)) == k2
    assert key_to_name(to_kvbucket_key(k0)) == "org%2Fllama@1000100@" + (7).to_bytes(16, "big").hex()
    assert key_to_name(to_kvbucket_key(k2)) != key_to_name(to_kvbucket_key(lmkey(7, "t")))


def test_plugin_rejects_bad_adapter_params_naming_the_field(tmp_path: Path) -> None:
    import argparse

    ns = argparse.Namespace(
        l2_adapter=[
            plugin_spec({"type": "fs", "base_path": str(tmp_path), "create_bucket_if_missing": "false"})
        ]
    )
    cfg = parse_args_to_l2_adapters_config(ns)
    with pytest.raises(ValueError, match="'create_bucket_if_missing'"):
        create_l2_adapter(cfg.adapters[0])


# ---- non-MP connector --------------------------------------------------------------------------------
def test_connector_loads_through_remote_storage_plugins_and_round_trips(
    tmp_path: Path, lm_loop: asyncio.AbstractEventLoop
) -> None:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    base = tmp_path / "remote"
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16,
        local_cpu=False,
        max_local_cpu_size=0.05,
        save_unfull_chunk=False,
        remote_serde="naive",
        remote_storage_plugins=["kvbucket"],
        extra_config={
            "remote_storage_plugin.kvbucket.module_path": "kvbucket.integrations.lmcache",
            "remote_storage_plugin.kvbucket.class_name": "KVBucketConnector",
            "remote_storage_plugin.kvbucket.bucket_handle": f"file://{base}",
            "remote_storage_plugin.kvbucket.metadata_cache_ttl_secs": 5,
        },
    )
    md = LMCacheMetadata(
        model_name="org/llama",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(2, 2, 16, 2, 8),
        chunk_size=16,
    )
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    backend = RemoteBackend(cfg, md, lm_loop, cpu, "cpu", plugin_name="kvbucket")
    try:
        assert "KVBucketConnector" in repr(backend.connection)
        keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in (0x1234, -0x77, 0xABCDEF)]
        objs = []
        for i, _ in enumerate(keys):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(i + 1)
            objs.append(obj)
        backend.batched_submit_put_task(keys, objs)
        # the put is asynchronous and LMCache offers no completion handle: wait for the objects
        names = [key_to_name(k.to_string()) for k in keys]
        store = FileStore(base)
        deadline = time.monotonic() + 20
        while not all(store.exists(n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.batched_contains(keys) == 3
        assert backend.contains(keys[1])
        got = backend.get_blocking(keys[2])
        assert got is not None and bytes(got.byte_array) == bytes([3]) * got.get_size()
        got.ref_count_down()
        for obj in objs:
            obj.ref_count_down()
        missing = CacheEngineKey("org/llama", 1, 0, 0x999, torch.bfloat16)
        assert backend.get_blocking(missing) is None
        # on disk: one 0600 file per chunk, named by the reversible key encoding
        files = sorted(p.name for p in base.iterdir() if not p.name.startswith("."))
        assert files == sorted(key_to_name(k.to_string()) for k in keys)
        assert all((base / f).stat().st_mode & 0o777 == 0o600 for f in files)
        listed = asyncio.run_coroutine_threadsafe(backend.connection.list(), lm_loop).result(10)
        assert sorted(listed) == sorted(k.to_string() for k in keys)
    finally:
        backend.close()


def test_connector_config_is_strict(tmp_path: Path) -> None:
    from kvbucket.errors import ConfigError
    from kvbucket.integrations.lmcache import connector_config_from_extra

    pre = "remote_storage_plugin.hf.eu."
    cfg = connector_config_from_extra(
        {
            pre + "bucket_handle": "hf://buckets/org/kv/prod",
            pre + "token_env": "HF_EU_TOKEN",
            pre + "create_bucket_if_missing": False,
        },
        "hf.eu",
    )
    assert cfg.type == "hfbucket" and cfg.token_env == "HF_EU_TOKEN"
    s3 = connector_config_from_extra(
        {
            "remote_storage_plugin.s.bucket_handle": "s3://b/p",
            "remote_storage_plugin.s.s3_region": "us-east-1",
        },
        "s",
    )
    assert s3.type == "s3"
    # read as leniently as LMCache reads its plugin options, but junk is an error naming the key
    lenient = connector_config_from_extra({pre + "bucket_handle": "hf://buckets/org/kv",
                                           pre + "create_bucket_if_missing": "yes",
                                           pre + "metadata_cache_ttl_secs": "5"}, "hf.eu")  # fmt: skip
    assert lenient.create_bucket_if_missing is True and lenient.metadata_cache_ttl_secs == 5.0
    with pytest.raises(ConfigError, match="create_bucket_if_missing"):
        connector_config_from_extra(
            {pre + "bucket_handle": "hf://buckets/org/kv", pre + "create_bucket_if_missing": "maybe"}, "hf.eu"
        )
    with pytest.raises(ConfigError, match="'bucket_hanlde'"):
        connector_config_from_extra(
            {pre + "bucket_handle": "hf://buckets/org/kv", pre + "bucket_hanlde": "x"}, "hf.eu"
        )
    with pytest.raises(ConfigError, match="bucket_handle is required"):
        connector_config_from_extra({}, "hf.eu")
