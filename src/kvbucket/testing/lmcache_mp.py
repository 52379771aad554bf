"""Drive a real ``lmcache server`` as vLLM does, with LMCache's own MP client code (tests only).

:class:`MPEngine` is what ``LMCacheMPConnector`` (lmcache 0.5.6, vLLM's MP connector) runs:
``LMCacheMPSchedulerAdapter`` for lookups (which lock the chunks and prefetch them from L2 into
L1) and ``LMCacheMPWorkerAdapter`` for stores and retrieves between a paged KV cache and the
server. The KV cache is a CPU tensor per layer in vLLM's flash-attention shape
``[2, num_blocks, block_size, heads, head_size]``, moved with LMCache's ``engine_driven`` transfer
mode (the worker gathers/scatters the blocks; the server must run with
``--supported-transfer-mode engine_driven``). The default ``lmcache_driven`` mode is CUDA/NPU IPC.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

BLOCK = 16  # tokens per vLLM block (= the server's --chunk-size: one block per chunk)


class MPEngine:
    """One engine worker and its scheduler, connected to one server."""

    def __init__(
        self, url: str, model: str, *, layers: int = 2, blocks: int = 8, timeout: float = 30.0, seed: int = 1
    ) -> None:
        self.ctx = zmq.Context()
        self.timeout = timeout
        ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                              n_servers=1)  # fmt: skip
        extra = {"lmcache.mp.mp_transfer_mode": "engine_driven", "lmcache.mp.mq_timeout": timeout}
        self.worker = LMCacheMPWorkerAdapter(url, self.ctx, model, BLOCK, ps, extra_config=extra)
        self.scheduler = LMCacheMPSchedulerAdapter([url], self.ctx, model, BLOCK, ps, extra_config=extra)
        gen = torch.Generator().manual_seed(seed)
        self.kv = {
            f"model.layers.{i}.self_attn.attn": torch.randn(2, blocks, BLOCK, 2, 16, generator=gen).to(
                torch.bfloat16
            )
            for i in range(layers)
        }
        # layout_hints given: without vLLM installed, LMCache would log an error asking vLLM for it.
        self.worker.register_kv_caches(self.kv, layout_hints={})  # type: ignore[arg-type]
        self._n = 0

    def blocks(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy of the given blocks of every layer."""
        return {name: t[:, ids].clone() for name, t in self.kv.items()}

    def store(self, tokens: list[int], block_ids: list[int]) -> None:
        rid = self._rid("store")
        self.worker.submit_store_request(rid, LoadStoreOp(tokens, [block_ids], 0, len(tokens)), None)
        self._until(lambda: rid in (self.worker.get_finished({rid})[0] or ()), f"store {rid}")

    def lookup(self, tokens: list[int]) -> tuple[str, int]:
        """Lookup (locks the chunks, prefetches them from L2): (request id, tokens hit)."""
        rid = self._rid("req")
        self.scheduler.maybe_submit_lookup_request(rid, tokens)
        deadline = time.monotonic() + self.timeout
        while (hit := self.scheduler.check_lookup_result(rid)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"lookup {rid} did not finish within {self.timeout} s")
            time.sleep(0.02)
        return rid, hit

    def retrieve(self, rid: str, tokens: list[int], block_ids: list[int]) -> None:
        """Retrieve a looked-up request's chunks into ``block_ids`` (zeroed first)."""
        for t in self.kv.values():
            t[:, block_ids] = 0
        self.worker.submit_retrieve_request(rid, LoadStoreOp(tokens, [block_ids], 0, len(tokens)), None)
        self._until(lambda: rid in (self.worker.get_finished(set())[1] or ()), f"retrieve {rid}")
        errors = self.worker.get_block_ids_with_load_errors()
        assert not errors, f"retrieve {rid}: load errors on blocks {sorted(errors)}"
        self.scheduler.cleanup_lookup_result(rid)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
        self.ctx.destroy(linger=0)

    def _rid(self, kind: str) -> str:
        self._n += 1
        return f"{kind}-{self._n}"

    def _until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not finish within {self.timeout} s")
            time.sleep(0.02)


__all__ = ["BLOCK", "MPEngine"]
