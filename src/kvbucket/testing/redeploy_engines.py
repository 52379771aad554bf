"""The vLLM and SGLang steps of :mod:`kvbucket.testing.redeploy` (run inside their venvs).

``store`` is a JSON target ``{"url", "options", "prefix"}`` (a directory, a Hub bucket, an S3
bucket, as tests/engines' checks get them); the model is the directory the engine loaded: vLLM's
``OffloadingModelConfig.name`` (the secondary tier is built by vLLM's own ``OffloadingSpecFactory``
and ``TieringOffloadingManager``), SGLang's ``HiCacheStorageConfig.model_name`` (the backend is
built by SGLang's ``StorageBackendFactory``, over SGLang's host KV pool).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

N = 4  # chunks per step (every path of kvbucket.testing.redeploy)
PAGE = 16  # SGLang tokens per page


def digest(data: Any) -> str | None:
    """SHA-256 of a chunk's bytes (None: a miss), as every step reports them."""
    import hashlib

    return None if data is None else hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def vllm_step(mode: str, model: Path, store: str) -> dict[str, Any]:
    from kvbucket.testing import vllm_engine

    t = json.loads(store)
    entry = {"type": "KVBucketSecondaryTier", "module_path": "kvbucket.integrations.vllm",
             "store_url": t["url"], "store_options": t.get("options", {}), "prefix": t["prefix"]}
    e = vllm_engine.Engine([entry], model=str(model))
    try:
        token = e.tier.identity.token if e.tier.identity is not None else None
        keys = vllm_engine.offload_keys(77, N)
        if mode == "store":
            kv = e.kv_data(77, N)
            e.store(keys, kv)
            return {"token": token, "hits": None, "digests": [digest(kv[i].numpy()) for i in range(N)]}
        hits, got = e.load(keys)
        return {"token": token, "hits": hits,
                "digests": [digest(got[i].numpy()) if i < hits else None for i in range(N)]}
    finally:
        e.close()


def sglang_step(mode: str, model: Path, store: str) -> dict[str, Any]:
    from array import array

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    t = json.loads(store)
    layers, heads, dim = 3, 2, 8
    device = MHATokenToKVPool(size=512, page_size=PAGE, dtype=torch.bfloat16, head_num=heads,
                              head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                              enable_alt_stream=False)
    pool = MHATokenToKVPoolHost(device._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0,
                                page_size=PAGE, layout="layer_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=512, start_layer=0, end_layer=layers)
    extra = {"backend_name": "kvbucket", "module_path": "kvbucket.integrations.sglang",
             "class_name": "KVBucketHiCacheStorage", "interface_v1": 1, "store_url": t["url"],
             "store_options": t.get("options", {}), "prefix": t["prefix"]}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=False,
                               model_name=str(model), extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    token = b.identity.token if b.identity is not None else None
    tokens = array("q", [(77 * 7919 + i) % 32000 for i in range(N * PAGE)])
    keys = get_storage_hash_str(RadixKey(tokens, cache_salt=None), None, page_size=PAGE)

    def pages(idx: Any) -> list[bytes]:
        flat = [pool.get_data_page(int(idx[p * PAGE]), flat=True).contiguous() for p in range(N)]
        return [f.view(torch.uint8).numpy().tobytes() for f in flat]

    if mode == "store":
        idx = pool.alloc(N * PAGE)
        g = torch.Generator().manual_seed(77)
        for p in range(N):
            page = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=g).to(pool.dtype)
            pool.set_from_flat_data_page(int(idx[p * PAGE]), page)
        assert b.batch_set_v1(keys, idx) == [True] * N
        return {"token": token, "hits": None, "digests": [digest(p) for p in pages(idx)]}
    hits = b.batch_exists(keys)
    idx = pool.alloc(N * PAGE)
    got = b.batch_get_v1(keys, idx)
    return {"token": token, "hits": hits,
            "digests": [digest(data) if ok else None for ok, data in zip(got, pages(idx), strict=True)]}


__all__ = ["sglang_step", "vllm_step"]
