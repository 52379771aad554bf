"""Model identity on the LMCache paths, through LMCache's own classes: the MP L2 adapter (built
by LMCache's ``create_l2_adapter``) and the non-MP connector (with LMCache's engine config,
metadata and CPU backend). A second process with the same model name but other weights, another
revision or another ``rope_scaling`` misses every chunk and deletes nothing; a third with the
first one's identity (its files copied elsewhere) hits every chunk, byte-identical."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from kvbucket.errors import ConfigError
from kvbucket.identity.core import identity_of_dir
from kvbucket.identity.manifest import read_identities
from kvbucket.integrations.lmcache import KVBucketConnector
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.identity_models import OTHER_VARIANTS, make_model_dirs
from kvbucket.testing.l2 import drain_fd, lmcache_memory_obj, wait_fd

pytestmark = pytest.mark.lmcache

MODEL = "org/llama"
N = 5
CHUNK = 4096


def tokens(tmp_path: Path) -> dict[str, str]:
    dirs = make_model_dirs(tmp_path / "models")
    return {k: identity_of_dir(p, MODEL).token for k, p in dirs.items()}


def payload(i: int) -> bytes:
    return bytes([i + 7]) * (CHUNK - 4) + i.to_bytes(4, "big")


def objects(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- MP: LMCache's factory builds the plugin adapter ------------------------------------------
def mp_adapter(root: Path, **params: Any) -> Any:
    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter",
                       "adapter_params": {"type": "fs", "base_path": str(root), **params}})
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return create_l2_adapter(cfg.adapters[0])


def lmkeys() -> list[LMKey]:
    return [LMKey(chunk_hash=(i + 1).to_bytes(16, "big"), model_name=MODEL, kv_rank=0x01000100,
                  object_group_id=0, cache_salt="") for i in range(N)]  # fmt: skip


def mp_store(adapter: Any, keys: list[LMKey]) -> None:
    tid = adapter.submit_store_task(keys, [lmcache_memory_obj(payload(i)) for i in range(len(keys))])
    assert wait_fd(adapter.get_store_event_fd())
    drain_fd(adapter.get_store_event_fd())
    assert adapter.pop_completed_store_tasks()[tid].is_successful()


def mp_read(adapter: Any, keys: list[LMKey]) -> tuple[list[int], list[int]]:
    """(lookup hits, loads with the stored bytes), as indices."""
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


def test_mp_adapter_other_identity_misses_and_deletes_nothing(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    ids, root, keys = tokens(tmp_path), tmp_path / "kv", lmkeys()
    assert len({ids[k] for k in ("base", *OTHER_VARIANTS)}) == 4 and ids["copy"] == ids["base"]
    first = mp_adapter(root, model_identity=ids["base"])
    try:
        mp_store(first, keys)
        assert mp_read(first, keys) == (list(range(N)), list(range(N)))
    finally:
        first.close()
    chunk_names = [n for n in objects(root) if not n.startswith("_identity/")]
    assert len(chunk_names) == N and all(n.startswith(f"org%2Fllama~{ids['base']}@") for n in chunk_names)
    # the first writer recorded its identity in the namespace's manifest
    assert set(read_identities(FileStore(root), "", MODEL)) == {ids["base"]}
    before = objects(root)
    for variant in OTHER_VARIANTS:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
            other = mp_adapter(root, model_identity=ids[variant])
            try:
                assert mp_read(other, keys) == ([], []), variant
                # the manifest was read on first sight of the model, in the background
                manifest = other.impl.naming.on_model.__self__._manifests[MODEL]
                assert manifest.checked.wait(10) and set(manifest.seen or {}) == {ids["base"]}
            finally:
                other.close()
        assert objects(root) == before, f"{variant}: nothing deleted, nothing rewritten"
        said = [r.getMessage() for r in caplog.records]
        assert any(ids["base"] in m and "model_identity" in m for m in said), said
    third = mp_adapter(root, model_identity=ids["copy"])
    try:
        assert mp_read(third, keys) == (list(range(N)), list(range(N)))
    finally:
        third.close()


def test_mp_adapter_name_only_chunks_need_accept_name_only(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    ids, root, keys = tokens(tmp_path), tmp_path / "kv", lmkeys()
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        legacy = mp_adapter(root)  # no identity: names as before this change
        try:
            mp_store(legacy, keys)
        finally:
            legacy.close()
    assert sorted(objects(root)) == sorted(f"org%2Fllama@1000100@{(i + 1).to_bytes(16, 'big').hex()}"
                                           for i in range(N))  # fmt: skip
    strict = mp_adapter(root, model_identity=ids["base"])
    try:
        assert mp_read(strict, keys) == ([], [])
    finally:
        strict.close()
    accepting = mp_adapter(root, model_identity=ids["base"], accept_name_only=True)
    try:
        assert mp_read(accepting, keys) == (list(range(N)), list(range(N)))
    finally:
        accepting.close()
    assert len(objects(root)) == N


def test_lmcache_format_cannot_carry_an_identity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot carry a model identity"):
        mp_adapter(tmp_path / "kv", model_identity="org/llama@main", object_format="lmcache")


# ---- non-MP: LMCache's engine config, metadata and CPU backend ------------------------------------
def engine(extra: dict[str, Any]) -> tuple[Any, Any, Any]:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=False, max_local_cpu_size=0.05,
                                            save_unfull_chunk=False, remote_serde="naive",
                                            remote_storage_plugins=["kv"], extra_config=extra)  # fmt: skip
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 64),
                         chunk_size=16)  # fmt: skip
    return cfg, md, LocalCPUBackend(cfg, md, dst_device="cpu")


def connector(loop: Any, root: Path, **extra: Any) -> KVBucketConnector:
    pre = "remote_storage_plugin.kv."
    cfg, _, cpu = engine({pre + "module_path": "kvbucket.integrations.lmcache",
                          pre + "class_name": "KVBucketConnector", pre + "bucket_handle": f"file://{root}",
                          pre + "metadata_cache_ttl_secs": 0,
                          **{pre + k: v for k, v in extra.items()}})  # fmt: skip
    return KVBucketConnector(loop=loop, local_cpu_backend=cpu, config=cfg)


def run(loop: Any, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def ce_keys() -> list[CacheEngineKey]:
    return [CacheEngineKey(MODEL, 1, 0, h, torch.bfloat16) for h in range(0x100, 0x100 + N)]


def conn_put(conn: KVBucketConnector, loop: Any, keys: list[CacheEngineKey]) -> None:
    from lmcache.v1.memory_management import MemoryFormat

    cpu, md = conn.local_cpu_backend, conn.local_cpu_backend.metadata
    for i, k in enumerate(keys):
        obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
        obj.raw_data.view(torch.uint8).fill_(i + 1)
        run(loop, conn.put(k, obj))


def conn_read(conn: KVBucketConnector, loop: Any, keys: list[CacheEngineKey]) -> tuple[int, list[int]]:
    hits = run(loop, conn.batched_async_contains("t", keys))
    got = run(loop, conn.batched_get(keys))
    return hits, [i for i, o in enumerate(got)
                  if o is not None and bytes(o.byte_array) == bytes([i + 1]) * o.get_size()]  # fmt: skip


def test_connector_other_identity_misses_and_deletes_nothing(tmp_path: Path, lm_loop: Any) -> None:
    ids, root, keys = tokens(tmp_path), tmp_path / "kv", ce_keys()
    first = connector(lm_loop, root, model_identity=ids["base"])
    conn_put(first, lm_loop, keys)
    assert conn_read(first, lm_loop, keys) == (N, list(range(N)))
    run(lm_loop, first.close())
    before = objects(root)
    assert sum(1 for n in before if n.startswith(f"org%2Fllama~{ids['base']}@")) == N
    for variant in OTHER_VARIANTS:
        other = connector(lm_loop, root, model_identity=ids[variant])
        assert conn_read(other, lm_loop, keys) == (0, []), variant
        assert run(lm_loop, other.list()) == []
        run(lm_loop, other.close())
        assert objects(root) == before, f"{variant}: nothing deleted"
    third = connector(lm_loop, root, model_identity=ids["copy"])
    assert conn_read(third, lm_loop, keys) == (N, list(range(N)))
    assert sorted(run(lm_loop, third.list())) == sorted(k.to_string() for k in keys)
    run(lm_loop, third.close())
