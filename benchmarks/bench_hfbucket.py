"""kvbucket's HFBucketStore vs LMCache 0.5.6's HFBucketL2Adapter, same emulator, same process.

    PYTHONPATH=src python benchmarks/bench_hfbucket.py [--chunks 256] [--chunk-mib 2] [--rounds 3]

Both clients talk to one local Hub emulator (kvbucket.testing.HubEmulator, run in a child process
so its CPU work does not share this process's GIL) through the unmodified huggingface_hub and
hf_xet. Each system gets its own bucket and its own chunks of the same sizes, refilled with new
bytes before every round so no store is helped by deduplication: realistic bf16 KV by default
(``--payloads kv``, :mod:`kvbucket.testing.payloads`: Xet compresses it, so a load decodes it),
random bytes with ``--payloads random`` (the second row: ``bench_hfbucket-random.json``).
Rounds alternate which system goes first. Measured per round, medians printed:

- store: all chunks in one call (LMCache: one store task; kvbucket: one put_many)
- lookup + load: what a hit costs, on a fresh instance with default settings: a lookup of the
  stored chunks, then at once their load into preallocated buffers (bytes verified afterwards).
  kvbucket's lookup hit also asks for the Xet reconstructions (``prefetch_reconstructions``, on
  by default), so that its load is the fetch alone: timed apart, its lookup would carry part of
  the load's work; together they are the honest figure
- lookup cold: 1,000 keys (the stored ones + misses) on a fresh instance (empty metadata cache),
  kvbucket with ``prefetch_reconstructions`` off, so the lookup does only the lookup
- lookup warm: the same 1,000 keys again on that instance
- load: every chunk on a fresh instance with no lookup before it (each side's load finds the
  files itself; LMCache's load never uses its cache), bytes verified afterwards

Ratios are LMCache time / kvbucket time (> 1 means kvbucket is faster). Goal: >= 1.5 on load
(and lookup + load) and cold lookup, >= 1.0 on store.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Own HF_HOME/xet cache before huggingface_hub or hf_xet are imported (see docs/emulator.md).
_HOME = tempfile.mkdtemp(prefix="kvbucket-bench-hf-")
atexit.register(shutil.rmtree, _HOME, True)
os.environ["HF_HOME"] = _HOME
os.environ["HF_XET_CACHE"] = os.path.join(_HOME, "xet")
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import numpy as np  # noqa: E402

from kvbucket.keys import ObjectKey as KVObjectKey  # noqa: E402
from kvbucket.keys import key_to_name  # noqa: E402
from kvbucket.stores.hub.config import HFBucketConfig  # noqa: E402
from kvbucket.stores.hub.store import HFBucketStore  # noqa: E402
from kvbucket.testing import HubEmulator  # noqa: E402
from kvbucket.testing.payloads import KINDS, payload  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_adapters as lmc  # noqa: E402
from results import Results, add_argument  # noqa: E402

TOKEN = "hf_bench_write_token_0001"
OPS = ("store", "lookup + load", "lookup cold", "lookup warm", "load")
LOOKUPS = ("lookup cold", "lookup warm")  # 1,000 keys, hits and misses; the others move the chunks
GOALS = {"store": 1.0, "lookup + load": 1.5, "lookup cold": 1.5, "lookup warm": None, "load": 1.5}
MODEL = "bench-model"


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class LMCacheSide:
    """LMCache's own MP adapter, driven like `lmcache bench l2` drives it (:mod:`lmcache_adapters`)."""

    def __init__(self, endpoint: str, bucket: str, chunks: list[np.ndarray], lookup_extra: int) -> None:
        import torch
        from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys

        self.torch = torch
        self.handle = f"hf://buckets/me/{bucket}"
        self.endpoint = endpoint
        n, size = len(chunks), chunks[0].nbytes
        self.chunks = chunks
        self.keys = make_object_keys(n, model_name=MODEL)
        self.lookup_keys = self.keys + make_object_keys(lookup_extra, model_name=MODEL, key_offset=10**6)
        self.src = [lmc.memory_obj(torch.from_numpy(c)) for c in chunks]
        self.dst_buf = torch.zeros(n * size, dtype=torch.uint8)
        self.dst = [lmc.memory_obj(self.dst_buf[i * size : (i + 1) * size]) for i in range(n)]

    def adapter(self) -> Any:
        return lmc.open_adapter({"type": "hfbucket", "bucket_handle": self.handle, "token": TOKEN,
                                "create_bucket_if_missing": True}, self.endpoint)

    def store(self, a: Any) -> int:
        return lmc.store(a, self.keys, self.src)

    def lookup(self, a: Any) -> int:
        hits = lmc.lookup_and_lock(a, self.lookup_keys)
        lmc.unlock(a, self.lookup_keys)
        return hits

    def load(self, a: Any, zero: bool = True) -> int:
        if zero:
            self.dst_buf.zero_()
        return lmc.load(a, self.keys, self.dst)

    def lookup_load(self, a: Any) -> int:
        """An engine's hit: lookup-and-lock the stored keys, load them, unlock."""
        return lmc.lookup_load(a, self.keys, self.dst)

    def zero(self) -> None:
        self.dst_buf.zero_()


class LMCacheConnectorSide:
    """LMCache's non-MP ``HFBucketConnector`` (the ``hfbucket`` remote storage plugin) on full chunks."""

    def __init__(self, endpoint: str, bucket: str, chunks: list[np.ndarray], lookup_extra: int) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self.torch = torch
        self.endpoint = endpoint
        n, size = len(chunks), chunks[0].nbytes
        heads = size // (2 * 2 * 256 * 128 * 2)  # 2 layers, K and V, 256 tokens, head 128, bf16
        assert heads * 2 * 2 * 256 * 128 * 2 == size, "--chunk-mib: steps of 0.25 here"
        self.meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.bfloat16,
                                    kv_shape=(2, 2, 256, heads, 128))
        self.cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, save_unfull_chunk=False, remote_storage_plugins=["hfbucket"],
            extra_config={"remote_storage_plugin.hfbucket.bucket_handle": f"hf://buckets/me/{bucket}",
                          "remote_storage_plugin.hfbucket.token": TOKEN,
                          "remote_storage_plugin.hfbucket.create_bucket_if_missing": True})
        self.chunks = chunks
        self.keys = [CacheEngineKey(MODEL, 1, 0, i + 1, torch.bfloat16) for i in range(n)]
        self.lookup_keys = self.keys + [CacheEngineKey(MODEL, 1, 0, -(i + 1), torch.bfloat16)
                                        for i in range(lookup_extra)]
        self.src = [lmc.memory_obj(torch.from_numpy(c)) for c in chunks]
        self.loaded: list[Any] = []

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> Any:
        """The connector allocates load buffers from the local CPU backend; plain tensors here."""
        n = int(sum(self.torch.Size(s).numel() * self.torch.tensor([], dtype=d).element_size()
                    for s, d in zip(shapes, dtypes, strict=True)))
        return lmc.memory_obj(self.torch.empty(n, dtype=self.torch.uint8))

    def adapter(self) -> Any:
        import asyncio

        import huggingface_hub.constants as hc
        from lmcache.v1.storage_backend.connector.hfbucket_connector import (
            HFBucketConnector,
            resolve_hfbucket_connector_config,
        )

        hc.ENDPOINT = self.endpoint
        plugin_cfg = resolve_hfbucket_connector_config(self.cfg, "hfbucket")
        conn = HFBucketConnector(self, self.cfg, self.meta, plugin_cfg)
        conn.close = lambda c=conn: asyncio.run(HFBucketConnector.close(c))  # sync close for run_round
        return conn

    def store(self, c: Any) -> int:
        import asyncio

        asyncio.run(c.batched_put(self.keys, self.src))
        return len(self.keys)

    def lookup(self, c: Any) -> int:
        return int(c.batched_contains(self.lookup_keys))  # consecutive prefix hits: the stored keys

    def load(self, c: Any) -> int:
        import asyncio

        self.loaded = asyncio.run(c.batched_get(self.keys))
        return sum(o is not None for o in self.loaded)

    def lookup_load(self, c: Any) -> int:
        """The non-MP engine's hit: batched_contains of the prompt's chunks, then batched_get."""
        return self.load(c) if int(c.batched_contains(self.keys)) == len(self.keys) else 0

    def zero(self) -> None:
        self.loaded = []


class KVBucketSide:
    def __init__(self, endpoint: str, bucket: str, chunks: list[np.ndarray], lookup_extra: int,
                 workers: int) -> None:
        n, size = len(chunks), chunks[0].nbytes
        keys = [KVObjectKey(MODEL, i, i.to_bytes(16, "big")) for i in range(n)]
        extra = [KVObjectKey(MODEL, i, i.to_bytes(16, "big")) for i in range(10**6, 10**6 + lookup_extra)]
        self.names = [key_to_name(k) for k in keys]
        self.lookup_names = self.names + [key_to_name(k) for k in extra]
        self.chunks = chunks
        self.dst = np.zeros(n * size, dtype=np.uint8)
        self.views = [memoryview(self.dst[i * size : (i + 1) * size]) for i in range(n)]
        self.cfg = HFBucketConfig(bucket_handle=f"hf://buckets/me/{bucket}", token=TOKEN, endpoint=endpoint,
                                  create_bucket_if_missing=True, num_workers=workers)
        # lookups alone: a lookup hit does not also ask for its Xet reconstruction for the load
        self.cfg_lookup_only = self.cfg.model_copy(update={"prefetch_reconstructions": False})

    def adapter(self, lookup_only: bool = False) -> HFBucketStore:
        return HFBucketStore.from_config(self.cfg_lookup_only if lookup_only else self.cfg)

    def store(self, s: HFBucketStore) -> int:
        res = s.put_many(list(zip(self.names, self.chunks, strict=True)))
        assert all(r.ok for r in res), [r.error for r in res if not r.ok][:3]
        return len(res)

    def lookup(self, s: HFBucketStore) -> int:
        return sum(r.found for r in s.head_many(self.lookup_names))

    def load(self, s: HFBucketStore, zero: bool = True) -> int:
        if zero:
            self.dst[:] = 0
        return sum(r.found for r in s.get_many(self.names, self.views))

    def lookup_load(self, s: HFBucketStore) -> int:
        """A hit: head_many of the stored chunks (reconstructions asked for), then get_many."""
        hits = sum(r.found for r in s.head_many(self.names))
        return self.load(s, zero=False) if hits == len(self.names) else 0

    def zero(self) -> None:
        self.dst[:] = 0


Samples = dict[str, list[tuple[float, float]]]  # op -> [(wall seconds, CPU seconds)]


def run_round(side: Any, t: Samples, verify: Callable[[], bool], server_cpu: Callable[[], float]) -> None:
    """One round of every operation, each on the instance a real deployment would have.

    CPU = this process's CPU time (all threads, incl. hf_xet's) + the emulator process's, so the
    comparison also holds on a loaded machine where wall time is noisy.
    """
    n = len(side.keys) if hasattr(side, "keys") else len(side.names)

    def measure(op: str, fn: Callable[[], int], expect: int) -> None:
        s0, c0, w0 = server_cpu(), time.process_time(), time.perf_counter()
        got = fn()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        cpu += server_cpu() - s0
        assert got == expect, f"{op}: {got} of {expect}"
        t[op].append((wall, cpu))

    a = side.adapter()
    try:
        measure("store", lambda: side.store(a), n)
    finally:
        a.close()
    a = side.adapter()
    try:
        side.zero()  # untimed: the buffers a hit loads into are there before it
        measure("lookup + load", lambda: side.lookup_load(a), n)
        assert verify(), "loaded bytes differ from stored bytes (lookup + load)"
    finally:
        a.close()
    a = side.adapter(lookup_only=True) if isinstance(side, KVBucketSide) else side.adapter()
    try:
        measure("lookup cold", lambda: side.lookup(a), n)
        measure("lookup warm", lambda: side.lookup(a), n)
    finally:
        a.close()
    a = side.adapter()
    try:
        measure("load", lambda: side.load(a), n)
        assert verify(), "loaded bytes differ from stored bytes"
    finally:
        a.close()


def _label(op: str, args: argparse.Namespace) -> str:
    """What a figure measured, as its row says it."""
    if op in LOOKUPS:
        return f"{op} ({args.lookup_keys:,} keys, kvbucket's prefetch_reconstructions off)"
    shape = f"{args.chunks} x {args.chunk_mib:g} MiB"
    return {"lookup + load": f"lookup + load ({shape}, fresh instance, defaults)",
            "load": f"load ({shape}, fresh instance, no lookup before it)"}.get(op, f"{op} ({shape})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--lookup-keys", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds first")
    ap.add_argument("--workers", type=int, default=4, help="num_workers of both systems' configs")
    ap.add_argument("--baseline", choices=("adapter", "connector"), default="adapter",
                    help="LMCache's MP HFBucketL2Adapter or its non-MP HFBucketConnector")
    ap.add_argument("--in-process-server", action="store_true", help="run the emulator in this process")
    ap.add_argument("--payloads", choices=KINDS, default=KINDS[0],
                    help="kv: realistic bf16 KV (the default); random: random bytes")
    add_argument(ap)
    args = ap.parse_args()
    variant = "-".join(v for v in (None if args.baseline == "adapter" else "connector",
                                   None if args.payloads == "kv" else args.payloads) if v)
    res = Results("bench_hfbucket", variant=variant or None, params=vars(args),
                  title="HFBucketStore vs LMCache 0.5.6's hfbucket adapter, Hub emulator",
                  notes=f"payloads: {'realistic bf16 KV' if args.payloads == 'kv' else args.payloads}")
    size = int(args.chunk_mib * 1024 * 1024)
    extra = max(0, args.lookup_keys - args.chunks)
    tag = os.urandom(4).hex()

    def chunks() -> list[np.ndarray]:
        return [np.zeros(size, np.uint8) for _ in range(args.chunks)]

    mib = args.chunks * size / 2**20
    baseline = "HFBucketL2Adapter (MP)" if args.baseline == "adapter" else "HFBucketConnector (non-MP)"
    print(f"baseline: LMCache 0.5.6 {baseline}")
    print(f"{args.chunks} chunks x {size / 2**20:.2f} MiB = {mib:.0f} MiB; "
          f"lookup of {args.lookup_keys} keys; {args.rounds} round(s); workers={args.workers}", flush=True)
    with HubEmulator(tokens={"me": (TOKEN, "write")}, subprocess=not args.in_process_server) as emu:
        lm_chunks, kv_chunks = chunks(), chunks()
        lm: Any
        if args.baseline == "adapter":
            lm = LMCacheSide(emu.endpoint, "lmcache-bench", lm_chunks, extra)
        else:
            lm = LMCacheConnectorSide(emu.endpoint, "lmcache-bench", lm_chunks, extra)
        kv = KVBucketSide(emu.endpoint, "kvbucket-bench", kv_chunks, extra, args.workers)

        def lm_ok() -> bool:
            got = lm.dst if args.baseline == "adapter" else lm.loaded
            return all(np.array_equal(d.raw_data.numpy().view(np.uint8).reshape(-1), c)
                       for d, c in zip(got, lm_chunks, strict=True))

        def kv_ok() -> bool:
            return all(np.array_equal(np.frombuffer(v, np.uint8), c) for v, c in zip(kv.views, kv_chunks,
                                                                                      strict=True))

        def server_cpu() -> float:
            return float(emu.stats()["process_cpu_s"])

        lm_t: Samples = {op: [] for op in OPS}
        kv_t: Samples = {op: [] for op in OPS}
        # Interleaved, alternating who goes first, so a noisy machine hurts both sides alike;
        # round 0 warms up connections and the server and is not counted.
        for r in range(args.rounds + args.warmup):
            order = [(lm, lm_t, lm_ok), (kv, kv_t, kv_ok)]
            for side, t, ok in order if r % 2 == 0 else order[::-1]:
                for i, c in enumerate(side.chunks):  # new bytes every round: a real upload, no dedup
                    c[:] = payload(args.payloads, c.nbytes, f"{tag}-{r}-{id(side)}-{i}")
                run_round(side, t, ok, server_cpu)
            if r < args.warmup:
                for t in (lm_t, kv_t):
                    for op in OPS:
                        t[op].clear()
                print(f"warm-up round {r + 1} done", flush=True)
                continue
            print(f"round {r + 1 - args.warmup}: " + "  ".join(
                f"{op} {lm_t[op][-1][0] / kv_t[op][-1][0]:.2f}x" for op in OPS), flush=True)
    head = (f"{'operation':<13}{'LMCache s':>10}{'kvbucket s':>11}{'LMCache':>14}{'kvbucket':>14}"
            f"{'ratio':>8}{'CPU ratio':>11}")
    print("\n" + head)
    met = True
    for op, goal in GOALS.items():
        a = statistics.median(w for w, _ in lm_t[op])
        b = statistics.median(w for w, _ in kv_t[op])
        cpu_a = statistics.median(c for _, c in lm_t[op])
        cpu_ratio = cpu_a / max(statistics.median(c for _, c in kv_t[op]), 1e-9)
        if op in LOOKUPS:
            ra, rb = f"{args.lookup_keys / a:,.0f} key/s", f"{args.lookup_keys / b:,.0f} key/s"
        else:
            ra, rb = f"{mib / a:,.0f} MiB/s", f"{mib / b:,.0f} MiB/s"
        ratio = a / b
        mark = "" if goal is None else ("  ok" if ratio >= goal else f"  < goal {goal}")
        met = met and (goal is None or ratio >= goal)
        print(f"{op:<13}{a:>10.3f}{b:>11.3f}{ra:>14}{rb:>14}{ratio:>7.2f}x{cpu_ratio:>10.2f}x{mark}")
        amount, unit = (args.lookup_keys, "keys/s") if op in LOOKUPS else (mib, "MiB/s")
        res.compare(op, _label(op, args), ours=amount / b, peer=amount / a,
                    peer_name=f"LMCache {baseline}", unit=unit, ratio=ratio, cpu_ratio=cpu_ratio,
                    goal=None if goal is None else f">= {goal}",
                    ratios=[lw / kw for (lw, _), (kw, _) in zip(lm_t[op], kv_t[op], strict=True)])
    for i in range(len(kv_t["load"])):
        sides = (("kvbucket", kv_t), ("lmcache", lm_t))
        res.run(round=i + 1, **{f"{who} {op} {m}": t[op][i][j] for who, t in sides
                               for op in OPS for j, m in enumerate(("wall_s", "cpu_s"))})
    res.write(args.results_dir)
    print("\nratio = LMCache wall time / kvbucket wall time (medians); CPU ratio = the same for CPU seconds "
          "(client + emulator).\ngoal: load, lookup + load and cold lookup >= 1.5x, store >= 1.0x; load avg "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs during the run")
    print("all goals met" if met else "some goals NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
