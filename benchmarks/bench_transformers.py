"""Prefix KV reuse on a transformers model: time to first token against the plain model, same run.

    PYTHONPATH=src python benchmarks/bench_transformers.py [--layers 8] [--prompt-tokens 4096]
        [--repeat 3] [--dtype float32] [--remote DIR]

A Qwen2.5-0.5B-shaped Llama (random weights; ``--layers`` trims depth to keep the run short on a
small machine: compute per token scales with layers, and so do chunk bytes, so ratios hold) answers
a document plus a question. Cases, each the median of ``--repeat`` rounds run round-robin so
drift on a shared machine hits every case alike:

- ``baseline``: plain ``model.generate`` (the denominator of every ratio);
- ``miss+store``: the prefix cache with an empty backend: computes everything and queues the
  stores; its ratio to the baseline is the cost the cache adds to a miss (goal: ~1.0, stores are
  off the critical path);
- ``hit local_cpu``: every document chunk in the memory tier;
- ``hit remote``: every document chunk in a RemoteBackend over a FileStore (``--remote`` to pick
  its directory, e.g. on another disk), fresh local tiers each round, so it measures a
  cross-machine hit minus the network.

Each row prints TTFT (seconds to the first new token) and TTFT / baseline.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from kvbucket.backends import HybridBackend, LocalCPUBackend, RemoteBackend
from kvbucket.backends.base import StorageBackend
from kvbucket.demo.model import QWEN05B_LIKE, build_model
from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout
from kvbucket.stores.file import FileStore


class _Clock(BaseStreamer):
    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def ttft(fn: Any, ids: torch.Tensor) -> float:
    clock = _Clock()
    t0 = time.perf_counter()
    fn(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, streamer=clock)
    assert clock.first is not None
    return clock.first - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--remote", type=Path, default=None, help="directory for the remote FileStore")
    args = p.parse_args()

    dims = replace(QWEN05B_LIKE, layers=args.layers)
    model = build_model(dims, seed=0, dtype=getattr(torch, args.dtype), name="bench")
    layout = probe_kv_layout(model)
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(0, dims.vocab_size, (1, args.prompt_tokens), generator=gen)
    question = torch.randint(0, dims.vocab_size, (1, 32), generator=gen)
    ids = torch.cat([doc, question], 1)
    with torch.inference_mode():
        model(ids[:, :64])  # warm-up outside every timing

    root = Path(tempfile.mkdtemp(prefix="kvbucket-bench-tf-"))
    remote_dir = args.remote or root / "remote"
    shared_cpu = LocalCPUBackend(4 * 2**30)
    remote_store = FileStore(remote_dir)
    # Fill both the memory tier and the remote once (not timed).
    with KVBucketPrefixCache(model, HybridBackend([shared_cpu, RemoteBackend(
        remote_store, layout.to_kv_layout(), owns_store=False
    )])) as filler:
        filler.prefill(ids)

    def miss_store() -> float:
        with KVBucketPrefixCache(model, LocalCPUBackend(4 * 2**30)) as c:
            return ttft(c.generate, ids)

    def hit_cpu() -> float:
        with KVBucketPrefixCache(model, shared_cpu, store=False) as c:
            t = ttft(c.generate, ids)
            assert c.last_stats.hit_tokens == args.prompt_tokens // 256 * 256
            return t

    def hit_remote() -> float:
        backend: StorageBackend = HybridBackend([
            LocalCPUBackend(4 * 2**30), RemoteBackend(remote_store, layout.to_kv_layout(), owns_store=False)
        ])
        with KVBucketPrefixCache(model, backend, store=False) as c:
            t = ttft(c.generate, ids)
            assert c.last_stats.hit_tokens == args.prompt_tokens // 256 * 256
        return t

    cases = {"baseline": lambda: ttft(model.generate, ids), "miss+store": miss_store,
             "hit local_cpu": hit_cpu, "hit remote": hit_remote}
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for r in range(args.repeat):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                times[name].append(cases[name]())
    finally:
        remote_store.close()
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(times["baseline"])
    print(f"model: Qwen2.5-0.5B-shaped Llama, {args.layers} layers, {args.dtype}; prompt "
          f"{args.prompt_tokens} + 32 tokens; chunk {layout.nbytes / 2**20:.1f} MiB; median of {args.repeat}")
    print(f"{'case':<16}{'TTFT s':>10}{'/ baseline':>12}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<16}{m:>10.3f}{m / base:>12.3f}")


if __name__ == "__main__":
    main()
