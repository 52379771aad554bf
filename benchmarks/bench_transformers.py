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
  cross-machine hit minus the network;
- ``hit hub N ms`` (``--hub-latency-ms 0,50``): every document chunk in a private bucket on the
  Hub emulator (its own process, the unmodified huggingface_hub/hf_xet), a freshly opened store
  and fresh local tiers each round (a second machine), with N ms added to every Hub and CAS
  request (the emulator's ``*`` latency rule): a cross-machine hit at that round-trip time.

Each row prints TTFT (seconds to the first new token) and TTFT / baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
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
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.local.file import FileStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument


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
    p.add_argument("--hub-latency-ms", default="",
                   help="comma-separated latencies (e.g. 0,50): add a 'hit hub N ms' case per value")
    add_argument(p)
    args = p.parse_args()
    latencies = [float(x) for x in args.hub_latency_ms.split(",") if x.strip()]
    res = Results("bench_transformers", params=vars(args),
                  title="transformers prefix reuse: time to first token against plain generate")

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
    stack = contextlib.ExitStack()
    open_hub = stack.enter_context(_hub(root, latencies)) if latencies else None
    hub_store = open_hub(None) if open_hub else None
    # Fill the memory tier, the remote and the bucket once (not timed).
    fill: list[StorageBackend] = [shared_cpu,
                                  RemoteBackend(remote_store, layout.to_kv_layout(), owns_store=False)]
    if hub_store is not None:
        fill.append(RemoteBackend(hub_store, layout.to_kv_layout(), owns_store=True))
    with KVBucketPrefixCache(model, HybridBackend(fill)) as filler:
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

    def hit_hub(latency_ms: float) -> float:
        assert open_hub is not None
        backend = HybridBackend([LocalCPUBackend(4 * 2**30),
                                 RemoteBackend(open_hub(latency_ms), layout.to_kv_layout(), owns_store=True)])
        try:
            with KVBucketPrefixCache(model, backend, store=False) as c:
                t = ttft(c.generate, ids)
                assert c.last_stats.hit_tokens == args.prompt_tokens // 256 * 256
        finally:
            backend.close()
        return t

    cases = {"baseline": lambda: ttft(model.generate, ids), "miss+store": miss_store,
             "hit local_cpu": hit_cpu, "hit remote": hit_remote}
    for ms in latencies:
        cases[f"hit hub {ms:g} ms"] = lambda ms=ms: hit_hub(ms)
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for r in range(args.repeat):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                times[name].append(cases[name]())
    finally:
        remote_store.close()
        stack.close()
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(times["baseline"])
    print(f"model: Qwen2.5-0.5B-shaped Llama, {args.layers} layers, {args.dtype}; prompt "
          f"{args.prompt_tokens} + 32 tokens; chunk {layout.nbytes / 2**20:.1f} MiB; median of {args.repeat}")
    print(f"{'case':<16}{'TTFT s':>10}{'/ baseline':>12}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<16}{m:>10.3f}{m / base:>12.3f}")
    res.figure("chunk_mib", layout.nbytes / 2**20, "MiB", label="KV chunk (256 tokens)")
    res.figure("prompt_tokens", args.prompt_tokens + 32, "tokens", label="prompt (document + question)")
    for name, ts in times.items():
        for i, t in enumerate(ts):
            res.run(case=name, round=i + 1, ttft_s=t)
        if name != "baseline":
            res.compare(name, f"TTFT, {name}", ours=statistics.median(ts), peer=base,
                        peer_name="recompute (plain generate)", ours_name=name, unit="s",
                        higher_is_better=False, of_baseline=statistics.median(ts) / base,
                        ratios=[b / t for b, t in zip(times["baseline"], ts, strict=True)])
    res.write(args.results_dir)


@contextlib.contextmanager
def _hub(root: Path, latencies: list[float]) -> Any:
    """A Hub emulator in its own process and a private bucket; yields ``open(latency_ms)``, which
    sets the latency every Hub and CAS request gets (``None``: leave it) and opens a fresh store."""
    from huggingface_hub import HfApi

    from kvbucket.stores import open_store
    from kvbucket.testing import HubEmulator
    from kvbucket.testing.hub_fixtures import isolate_hf_env, restore_env

    saved = isolate_hf_env(root / "hf-home")
    token = "hf_bench_" + os.urandom(8).hex()
    try:
        with HubEmulator(tokens={"bench": (token, "write")}, data_dir=root / "hub", subprocess=True) as emu:
            HfApi(endpoint=emu.endpoint, token=token).create_bucket("bench/kv", private=True)

            def open_at(latency_ms: float | None) -> ObjectStore:
                if latency_ms is not None:
                    emu.faults.reset()
                    if latency_ms:
                        emu.faults.add("*", latency_s=latency_ms / 1000)
                url = "hf://buckets/bench/kv/tf"
                return open_store(url, endpoint=emu.endpoint, token=token, token_env="")

            yield open_at
    finally:
        restore_env(saved)


if __name__ == "__main__":
    main()
