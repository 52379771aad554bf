"""LMCache 0.5.6 engine objects for tests of kvbucket's non-MP connector (needs the lmcache extra).

:func:`connector` builds a real ``KVBucketConnector`` the way LMCache does: an
engine config with a ``remote_storage_plugins`` entry, metadata for a small bf16 model, and a
``LocalCPUBackend`` that allocates the memory objects.
"""

from __future__ import annotations

import asyncio
from typing import Any

MODEL = "org/llama"


def connector(loop: asyncio.AbstractEventLoop | None, options: dict[str, Any], *, chunk_tokens: int = 16,
              plugin: str = "kv", store: Any = None, model: str = MODEL, head_dim: int = 8) -> Any:
    """A ``KVBucketConnector`` for ``remote_storage_plugin.<plugin>.<option>`` = ``options``;
    chunks of ``chunk_tokens`` tokens, kv_shape (2, 2, chunk_tokens, 2, head_dim) in bf16 of
    ``model``. ``store``: an object store to use instead of the one the options describe."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvbucket.integrations.lmcache import KVBucketConnector

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_tokens, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=[plugin],
        extra_config={f"remote_storage_plugin.{plugin}.module_path": "kvbucket.integrations.lmcache",
                      f"remote_storage_plugin.{plugin}.class_name": "KVBucketConnector",
                      **{f"remote_storage_plugin.{plugin}.{k}": v for k, v in options.items()}},
    )  # fmt: skip
    md = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk_tokens, 2, head_dim),
                         chunk_size=chunk_tokens)  # fmt: skip
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    return KVBucketConnector(loop=loop, local_cpu_backend=cpu, config=cfg, store=store)


__all__ = ["MODEL", "connector"]
