"""kvbucket's vLLM secondary tier vs vLLM's own ``fs`` tier on the same disk, through vLLM's own
``TieringOffloadingManager`` (and on the Hub emulator / SeaweedFS S3, the ``fs`` tier on disk
being the reference of the same run).

Both tiers are secondary tiers of vLLM 0.33.0's ``TieringOffloadingSpec``, loaded by its
``SecondaryTierFactory`` (``fs`` by type, kvbucket by module path) and driven as vLLM's scheduler
drives them (``kvbucket.testing.vllm_engine``): per round and tier, engine A offloads ``--chunks``
chunks in requests of ``--batch`` (the GPU worker's copy into the CPU tier is emulated; it needs
CUDA) and steps until every cascade to the tier finished: chunks/s written. Engine B, a fresh
engine on the same storage (a restart: empty CPU tier), schedules the same requests together,
looks their chunks up and steps until all are promoted into its CPU tier: chunks/s read, from the
first lookup to the last hit. The bytes read back are compared. vLLM's ``fs`` tier reads and
writes with O_DIRECT where the filesystem allows it (ext4 here), so before the reads the disk
tiers' files are dropped from the page cache (``posix_fadvise(DONTNEED)`` on their files only):
both read from the disk. Rounds alternate the tiers;
medians. (vLLM's plain CPU offloading keeps chunks in RAM and loses them on restart: not a
baseline for a persistent tier.)

Runs inside the vLLM venv (``engines/venv.sh vllm``); started with another Python it builds or
reuses that venv, starts the servers ``--stores`` asks for and re-runs itself there:

    python benchmarks/bench_vllm.py --chunks 256 --rounds 3
    python benchmarks/bench_vllm.py --chunks 128 --rounds 3 --stores dir,hub,s3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=256, help="chunks per round")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="KV bytes per chunk, in KiB")
    ap.add_argument("--batch", type=int, default=64, help="chunks per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the disk tiers write (default: a temp dir)")
    ap.add_argument("--stores", default="dir", help="kvbucket's stores, comma-separated: dir, hub, s3")
    ap.add_argument("--tier-options", default="{}", help="JSON: more settings of kvbucket's tier entries")
    add_argument(ap)
    args = ap.parse_args()
    from kvbucket.testing.engines import bench_in_engine_venv

    bench_in_engine_venv(ROOT, "vllm", args.stores, sys.argv)  # returns only inside the vllm venv
    run(args)


def run(args: argparse.Namespace) -> None:
    import logging

    import torch

    from kvbucket.testing.vllm_engine import Engine, offload_keys

    logging.disable(logging.WARNING)
    if args.dir is None:  # a temp dir of our own, removed at the end
        tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-")
        base = Path(tmp.name)
    else:
        base = Path(args.dir)
    from kvbucket.testing.engines import BENCH_TARGETS_ENV

    targets = json.loads(os.environ.get(BENCH_TARGETS_ENV, "{}")) or {"dir": {}}
    n, bs = args.chunks, args.chunk_kib * 1024
    batches = [list(range(i, min(n, i + args.batch))) for i in range(0, n, args.batch)]

    def tier(name: str, r: int) -> dict[str, Any]:
        if name == "vllm-fs":
            return {"type": "fs", "root_dir": str(base / f"fs-{r}")}
        t = targets[name.removeprefix("kvbucket-")]
        url = str(base / f"kvb-{r}") if name == "kvbucket-dir" else t["url"]
        return {"type": "KVBucketSecondaryTier", "module_path": "kvbucket.integrations.vllm",
                "store_url": url, "store_options": t.get("options", {}), "prefix": f"bench-r{r}",
                **json.loads(args.tier_options)}

    def one_round(name: str, r: int) -> tuple[float, float]:
        keys = offload_keys(1000 + r, n)
        a = Engine([tier(name, r)], block_bytes=bs, cpu_chunks=n + 8, poll_secs=0.001)
        kv = a.kv_data(r, n)
        t0 = time.perf_counter()
        for b in batches:
            a.store([keys[i] for i in b], kv[b], settle=False)
        a.settle()
        t1 = time.perf_counter()
        a.close()
        drop_cached(base)
        t1b = time.perf_counter()
        e = Engine([tier(name, r)], block_bytes=bs, cpu_chunks=n + 8, poll_secs=0.001)
        got = promote_all(e, [[keys[i] for i in b] for b in batches])
        t2 = time.perf_counter()
        assert torch.equal(got, kv), f"{name}: chunks read back differ"
        e.close()
        return n / (t1 - t0), n / (t2 - t1b)

    names = ["vllm-fs", *(f"kvbucket-{t}" for t in targets)]
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for r in range(args.rounds):  # alternate, so all see the same machine load
        for name in names:
            res[name].append(one_round(name, r))
    print(f"{n} chunks of {args.chunk_kib} KiB, requests of {args.batch}, {args.rounds} rounds, dir {base}")
    med = {k: (statistics.median(s for s, _ in v), statistics.median(g for _, g in v))
           for k, v in res.items()}
    fs, fg = med["vllm-fs"]
    for k, (s, g) in med.items():
        ratio = "" if k == "vllm-fs" else f"   vs vllm-fs (disk): store {s / fs:.2f}x load {g / fg:.2f}x"
        print(f"  {k:15s} store {s:8.1f} chunks/s   load {g:8.1f} chunks/s{ratio}")
    out = Results("bench_vllm", params=vars(args),
                  title="vLLM offloading: kvbucket's secondary tier against vLLM's own fs tier")
    for k, rounds in res.items():
        for i, (s, g) in enumerate(rounds):
            out.run(tier=k, round=i + 1, store_chunks_s=s, load_chunks_s=g)
        if k == "vllm-fs":
            continue
        base = res["vllm-fs"]
        for j, op in enumerate(("store", "load")):
            out.compare(f"{k} {op}", f"{op} ({k}, {args.chunk_kib} KiB chunks)", ours=med[k][j], ours_name=k,
                        peer=med["vllm-fs"][j], peer_name="vLLM fs tier (disk)", unit="chunks/s",
                        ratios=[a[j] / b[j] for a, b in zip(rounds, base, strict=True) if b[j]])
    out.write(args.results_dir)


def drop_cached(base: Path) -> None:
    """Write back and drop the page cache of the files under ``base`` (only those)."""
    for root, _, files in os.walk(base):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def promote_all(e: Any, requests: list[list[bytes]]) -> Any:
    """Schedule all requests together, as vLLM's scheduler does with waiting requests: scan every
    request's chunks each step (HIT/HIT_PENDING count, RETRY defers, MISS stops) until all hit;
    then read them out of the CPU tier (the GPU worker's copy, emulated)."""
    import torch
    from vllm.v1.kv_offload.base import LookupResult

    ctxs = [e.ctx() for _ in requests]
    with e.m.lock:
        for c in ctxs:
            e.m.on_new_request(c)
    deadline = time.monotonic() + 600
    while True:
        done = True
        with e.m.lock:
            for c, keys in zip(ctxs, requests, strict=True):
                for k in keys:
                    r = e.m.lookup(k, c)
                    if r is LookupResult.MISS:
                        raise AssertionError("a stored chunk was not found")
                    if r is not LookupResult.HIT:
                        done = False
        if done:
            break
        assert time.monotonic() < deadline, "promotions did not finish"
        e.step()
        time.sleep(e.poll_secs)
    out = []
    with e.m.lock:
        for c, keys in zip(ctxs, requests, strict=True):
            spec = e.m.prepare_load(keys, c)
            out.extend(e.cpu[int(i)].clone() for i in spec.chunk_ids)
            e.m.complete_load(keys, c)
            e.m.on_request_finished(c)
    return torch.stack(out)


if __name__ == "__main__":
    main()
