"""The scheduler side of a vLLM engine with secondary offloading tiers, on the CPU (needs vLLM).

Used by tests/engines/vllm_checks.py and benchmarks/bench_vllm.py inside the vLLM venv
(``engines/venv.sh vllm``). Everything is vLLM's own code: ``OffloadingSpecFactory`` builds the
``TieringOffloadingSpec`` from a ``kv_connector_extra_config``, whose ``TieringOffloadingManager``
keeps the CPU primary tier in vLLM's shared-memory region and loads the secondary tiers by type or
module path. :class:`Engine` calls the manager as vLLM's ``OffloadingConnectorScheduler`` does
(under ``manager.lock``, ``on_schedule_end`` once per step) and stands in only for the GPU
worker's copies into and out of the CPU tier, which need CUDA. Keys are vLLM's block hashes of
real ``Request`` objects.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.request import Request

TOKENS = 16  # tokens per block

init_none_hash(sha256)  # as vLLM's engine does at start (sha256: the same hashes in every process)
_HASHER = get_request_block_hasher(TOKENS, sha256)


def offload_keys(seed: int, n: int, salt: str | None = None) -> list[bytes]:
    """vLLM's keys of a request's blocks: its block hashes (the request's cache_salt is in them)."""
    tokens = [(seed * 7919 + i) % 32000 for i in range(n * TOKENS)]
    req = Request(f"req-{seed}", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=_HASHER)
    assert len(req.block_hashes) == n
    return [make_offload_key(h, 0) for h in req.block_hashes]


class Engine:
    """One engine's ``TieringOffloadingSpec`` and manager with the given secondary tier entries."""

    def __init__(self, tiers: list[dict[str, Any]], *, block_bytes: int = 8192, cpu_chunks: int = 32,
                 tp: int = 1, agnostic: bool = True, poll_secs: float = 0.01,
                 model: str = "org/Model-7B") -> None:
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * block_bytes * tp,
                 "secondary_tiers": tiers}
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=TOKENS, group_id=0,
                                          layer_names=("model.layers.0.attn", "model.layers.1.attn")),),
            worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False, extra_config=extra,
            engine_id=f"kvb-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
            cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1,
                                              dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None,
                                              is_parallelism_agnostic=agnostic))
        self.spec = OffloadingSpecFactory.create_spec(cfg)
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        view = self.m.primary_tier.get_kv_memoryview()
        self.cpu = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).reshape(view.shape))
        self.chunk_bytes = view.strides[0]
        self.poll_secs = poll_secs
        self._n = 0

    def ctx(self) -> ReqContext:
        self._n += 1
        return ReqContext(req_id=f"r{self._n}")

    def step(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 120.0) -> None:
        """Step until no transfer is in flight (vLLM steps while has_pending_work())."""
        deadline = time.monotonic() + timeout
        while True:
            with self.m.lock:
                self.m.on_schedule_end(ScheduleEndContext((), ()))
                if not self.m.has_pending_work():
                    return
            assert time.monotonic() < deadline, "transfers did not finish"
            time.sleep(self.poll_secs)

    def store(self, keys: list[bytes], kv: torch.Tensor, *, settle: bool = True) -> None:
        """Offload one request's chunks: the CPU tier gets them (the GPU worker's copy, emulated),
        then vLLM cascades them to the secondary tiers."""
        ctx = self.ctx()
        with self.m.lock:
            self.m.on_new_request(ctx)
            out = self.m.prepare_store(keys, ctx)
            assert out is not None and list(out.keys_to_store) == keys
            for i, c in enumerate(out.store_spec.chunk_ids):
                self.cpu[int(c)].copy_(kv[i])
            self.m.complete_store(keys, ctx)
            self.m.on_request_finished(ctx)
        if settle:
            self.settle()

    def prefix_hits(self, keys: list[bytes], ctx: ReqContext, timeout: float = 120.0) -> int:
        """Chunks found from the start, scanned as OffloadingConnectorScheduler._maximal_prefix_lookup
        scans them: HIT/HIT_PENDING count, RETRY keeps scanning and defers, MISS stops."""
        deadline = time.monotonic() + timeout
        while True:
            with self.m.lock:
                hits, defer = 0, False
                for k in keys:
                    r = self.m.lookup(k, ctx)
                    if r in (LookupResult.HIT, LookupResult.HIT_PENDING):
                        hits += 1
                        defer |= r is LookupResult.HIT_PENDING
                    elif r is LookupResult.RETRY:
                        defer = True
                    else:
                        break
            if not defer:
                return hits
            assert time.monotonic() < deadline, "lookups never resolved"
            self.step()
            time.sleep(self.poll_secs)

    def load(self, keys: list[bytes]) -> tuple[int, torch.Tensor]:
        """Look a request's chunks up and read the hits out of the CPU tier (the GPU worker's copy,
        emulated) into a fresh tensor; returns (hits, tensor)."""
        ctx = self.ctx()
        with self.m.lock:
            self.m.on_new_request(ctx)
        hits = self.prefix_hits(keys, ctx)
        out = torch.zeros((hits, self.chunk_bytes), dtype=torch.uint8)
        with self.m.lock:
            if hits:
                spec = self.m.prepare_load(keys[:hits], ctx)
                for i, c in enumerate(spec.chunk_ids):
                    out[i].copy_(self.cpu[int(c)])
                self.m.complete_load(keys[:hits], ctx)
            self.m.on_request_finished(ctx)
        return hits, out

    def kv_data(self, seed: int, n: int) -> torch.Tensor:
        """Random KV bytes for n chunks, as the GPU worker would copy them into the CPU tier."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn((n, self.chunk_bytes // 2), generator=g).to(torch.bfloat16).view(torch.uint8)

    def close(self) -> None:
        self.cpu = None  # type: ignore[assignment]  # our view of vLLM's region: it unmaps it
        self.m.shutdown()
