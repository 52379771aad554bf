"""What both vLLM check modules share (tests/engines/vllm_checks.py, vllm_connector_checks.py):
the stores from $KVB_VLLM_TARGETS and an engine whose one secondary tier is kvbucket on one of them.
Imported by the checks inside the vLLM venv; not a test module itself."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import torch

from kvbucket.integrations.vllm import KVBucketSecondaryTier
from kvbucket.testing import vllm_engine
from kvbucket.testing.vllm_engine import Engine

TARGETS: dict[str, dict[str, Any]] = json.loads(os.environ.get("KVB_VLLM_TARGETS", "{}"))
BLOCK_BYTES = 8192  # one worker's KV bytes per block
N = 6  # chunks per request


def store_target(name: str) -> dict[str, Any]:
    """The target ``name`` in a namespace of its own (each check module's ``target`` fixture)."""
    t = dict(TARGETS[name])
    t["name"] = name
    t["prefix"] = f"vllm-{uuid.uuid4().hex[:12]}"  # each check its own namespace in the shared store
    return t


def engine(target: dict[str, Any], *, salt: str = "", tp: int = 1, agnostic: bool = True,
           cpu_chunks: int = 32, model: str = "org/Model-7B", **tier: Any) -> Engine:
    """An engine whose one secondary tier is kvbucket on ``target``."""
    entry = {"type": "KVBucketSecondaryTier", "module_path": "kvbucket.integrations.vllm",
             "store_url": target["url"], "store_options": target.get("options", {}),
             "prefix": target["prefix"], **tier}
    if salt:
        entry["cache_salt"] = salt
    e = Engine([entry], block_bytes=BLOCK_BYTES, tp=tp, agnostic=agnostic, cpu_chunks=cpu_chunks, model=model)
    assert isinstance(e.tier, KVBucketSecondaryTier)
    return e


def offload_keys(seed: int, n: int = N, salt: str | None = None) -> list[bytes]:
    return vllm_engine.offload_keys(seed, n, salt)


def kv_data(e: Engine, seed: int, n: int = N) -> torch.Tensor:
    return e.kv_data(seed, n)


def count_heads(tier: KVBucketSecondaryTier) -> list[int]:
    """Count the names the tier HEADs (wraps its store's head_many on this instance)."""
    calls = [0]
    inner = tier.store.head_many

    def head_many(names: Any) -> Any:
        calls[0] += len(names)
        return inner(names)

    tier.store.head_many = head_many  # type: ignore[method-assign]
    return calls
