"""N nodes (spawned processes) on one prefix: capacity held, hit rate, coordination cost, warm start.

    PYTHONPATH=src python benchmarks/bench_fleet.py                      # S3 and the emulator, N = 1 2 4 8
    PYTHONPATH=src python benchmarks/bench_fleet.py --stores s3 --nodes 1,4 --startup-chunks 100000
    PYTHONPATH=src python benchmarks/bench_fleet.py --parts cost --stores s3 --nodes 2,4,8 --rate 30

Three parts (``--parts capacity,cost,startup``):

Capacity. For each store and N: a fresh prefix with a 1 MiB capacity (32 KiB chunks, fleet sync every
0.5 s, grace 1 s); N processes write 3x the capacity together, each reading a shared 4-chunk
hot set after every batch of 4 stores, then linger 6 s. The parent lists the prefix every 0.5 s
(peak) and once at the end (settled). Reported: settled and peak usage / capacity, hot-set hit
rate, and per node per minute the fleet's coordination requests vs its data requests (one
request per chunk stored or loaded; lookups are answered from the index).

Cost: N nodes, each making ``--rate`` data requests per second (default 30: 1,800 chunk requests
a minute, a serving node at LMCache's 256-token chunks; see docs/fleet.md "Request cost"): per
0.2 s, 3 chunk stores and 3 loads of a shared hot set. Two modes (``--modes``): clock-driven
(``sync_secs`` 5, the other settings default) and activity-paced (``coordination_ratio`` 0.01,
``max_sync_secs`` 60). The fleet's own counters (``coordination_requests``, ``data_requests``) are
read at ``--warm-secs`` and at the end of the writes: reported per node per minute over that
window, the compactor's and the other nodes' mean, the other nodes' coordination / data, and
the whole fleet's (the compactor reads and deletes every journal). Chunks are ``--chunk-kib``
(16 KiB) objects: the request counts, not the bytes, are what is measured.

Warm start: K chunks (tiny objects) in a prefix that a fleet node has compacted; then one new
adapter starts with the fleet (snapshot + journals) and one without (a full listing): store
requests and seconds until usage is complete, the ratio being the figure of merit (goal: >= 10x
fewer requests).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbucket.fleet.config import FleetConfig
from kvbucket.keys import key_to_name
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.fleet_node import key, run_node

CHUNK = 32 * 1024
CAPACITY = 1024 * 1024
FLEET = {"sync_secs": 0.5, "heartbeat_secs": 1.0, "node_timeout_secs": 6.0, "compact_secs": 2.0,
         "reconcile_secs": 10.0, "grace_secs": 1.0}
HOT = list(range(1_000_000, 1_000_004))


def chunk_bytes(store: ObjectStore, prefix: str) -> int:
    return sum(i.size for i in seal_store(store, tier="l2").list(prefix + "/") if "/_fleet/" not in i.name)


def fleet_run(spec: dict[str, Any], store: ObjectStore, prefix: str, n: int) -> dict[str, float]:
    spec = {**spec, "max_capacity_gb": CAPACITY / 1024**3, "full_chunk_bytes": CHUNK}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per_node = 3 * CAPACITY // CHUNK // n
    plans = [{"name": f"n{i}", "start": i * 100_000, "count": per_node, "chunk": CHUNK, "batch": 4,
              "hot": HOT, "pause": 0.05, "linger": 6.0} for i in range(n)]
    # A first node stores the hot set, then the N nodes start.
    seed = {"name": "seed", "start": HOT[0], "count": len(HOT), "chunk": CHUNK, "batch": 4}
    p = ctx.Process(target=run_node, args=({**spec, "fleet": {**FLEET, "node_id": "seed"}}, seed, out))
    p.start()
    out.get(timeout=120)
    p.join()
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.5):
            peak = max(peak, chunk_bytes(store, prefix))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = [ctx.Process(target=run_node, args=({**spec, "fleet": {**FLEET, "node_id": pl["name"]}}, pl, out))
             for pl in plans]
    for pr in procs:
        pr.start()
    reports = []
    while len(reports) < n:
        try:
            reports.append(out.get(timeout=300))
        except queue.Empty:
            break
    for pr in procs:
        pr.join(60)
    stop.set()
    sampler.join()
    errors = [r["error"] for r in reports if "error" in r]
    if errors or len(reports) < n:
        raise RuntimeError(f"nodes failed: {errors or 'timeout'}")
    settled = chunk_bytes(store, prefix)
    coord = [r["status"]["fleet"]["coordination_requests"] / (r["run_secs"] / 60) for r in reports]
    data = [r["data_requests"] / (r["run_secs"] / 60) for r in reports]
    return {
        "settled": settled / CAPACITY,
        "peak": max(peak, settled) / CAPACITY,
        "hit_rate": sum(r["hot_hits"] for r in reports) / max(1, sum(r["hot_reads"] for r in reports)),
        "coord_per_min": statistics.mean(coord),
        "data_per_min": statistics.mean(data),
        "cross_node_evictions": sum(r["status"]["fleet"]["evicted_cross_node"] for r in reports),
        "refused": sum(r["status"].get("refused_full", 0) for r in reports),
    }


#: LMCache's default chunk is 256 tokens: 8 MiB of Llama-3.2-1B's KV in bf16. Coordination
#: depends on request counts only, so the cost part moves --chunk-kib (default 16 KiB) per request
#: to reach a serving node's request rate on this 2-core machine. The capacity, 8,192 chunks (64
#: GiB of 8 MiB ones), is large enough that at N = 8 the write cap's per-round budget
#: (``2 * capacity / (3N - 2)`` on an empty prefix) exceeds what a node stores in a paced round,
#: so refused stores do not lower the data rate; eviction starts near the end at N = 8.
COST_CAPACITY_CHUNKS = 8192
#: Clock-driven: the defaults. Activity-paced: coordination_ratio (and max_sync_secs) as given.
MODES = ("clock", "paced")


def cost_run(spec: dict[str, Any], n: int, rate: float, secs: float, fleet: dict[str, Any],
             chunk: int, warm: float) -> dict[str, float]:
    """N nodes at a steady ``rate`` data requests/s each (per period: 3 stores and 3 loads of a
    shared hot set), counted by the fleet's own counters from ``warm`` s to the end."""
    spec = {**spec, "max_capacity_gb": COST_CAPACITY_CHUNKS * chunk / 1024**3, "full_chunk_bytes": chunk}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    hot = [2_000_000 + i for i in range(3)]
    seed = {"name": "seed", "start": hot[0], "count": len(hot), "chunk": chunk, "batch": len(hot)}
    p = ctx.Process(target=run_node, args=({**spec, "fleet": {**fleet, "node_id": "seed"}}, seed, out))
    p.start()
    out.get(timeout=300)
    p.join()
    batch = 3
    period = (batch + len(hot)) / rate
    plans = [{"name": f"n{i}", "start": i * 1_000_000, "count": batch * int(secs / period), "chunk": chunk,
              "batch": batch, "hot": hot, "period": period, "warm": warm} for i in range(n)]
    procs = [ctx.Process(target=run_node, args=({**spec, "fleet": {**fleet, "node_id": pl["name"]}}, pl, out))
             for pl in plans]
    for pr in procs:
        pr.start()
    reports = []
    while len(reports) < n:
        try:
            reports.append(out.get(timeout=secs + 300))
        except queue.Empty:
            break
    for pr in procs:
        pr.join(60)
    errors = [r["error"] for r in reports if "error" in r]
    if errors or len(reports) < n:
        raise RuntimeError(f"nodes failed: {errors or 'timeout'}")

    def window(r: dict[str, Any], what: str) -> float:
        w, end = r["warm_fleet"], r["status"]["fleet"]
        return (end[what] - w[what]) / ((r["write_secs"] - w["at"]) / 60)

    coord = [window(r, "coordination_requests") for r in reports]
    data = [window(r, "data_requests") for r in reports]
    lead = max(range(n), key=lambda i: reports[i]["status"]["fleet"].get("digests_written", 0))
    others = [c for i, c in enumerate(coord) if i != lead]
    other_data = [d for i, d in enumerate(data) if i != lead]
    return {"coord": statistics.mean(coord), "compactor": coord[lead],
            "other": statistics.mean(others) if others else float("nan"),
            "other_ratio": sum(others) / sum(other_data) if others else float("nan"),
            "data": statistics.mean(data), "fleet_ratio": sum(coord) / sum(data),
            "refused": sum(r["status"].get("refused_full", 0) for r in reports),
            "hit_rate": sum(r["hot_hits"] for r in reports) / max(1, sum(r["hot_reads"] for r in reports))}


def warm_start(store: ObjectStore, prefix: str, k: int) -> dict[str, float]:
    names = [key_to_name(key(i), prefix) for i in range(k)]
    for i in range(0, k, 2000):
        store.put_many([(nm, b"x" * 16) for nm in names[i : i + 2000]])
    fast = {**FLEET, "sync_secs": 0.5, "compact_secs": 0.5}
    a = ObjectStoreL2Adapter(store, prefix=prefix, owns_store=False, full_chunk_bytes=16,
                             fleet=FleetConfig(node_id="a", **fast))
    end = time.monotonic() + 600
    while a.report_status()["fleet"]["snapshots_written"] < 1 and time.monotonic() < end:
        time.sleep(0.2)
    a.close()
    out: dict[str, float] = {}
    for mode in ("listing", "fleet"):
        counted = CountingStore(store)
        t0 = time.perf_counter()
        b = ObjectStoreL2Adapter(counted, prefix=prefix, owns_store=False, full_chunk_bytes=16,
                                 fleet=FleetConfig(node_id="b", **{**FLEET, "sync_secs": 600.0})
                                 if mode == "fleet" else None)
        assert b.wait_until_rebuilt(600)
        out[f"{mode}_secs"] = time.perf_counter() - t0
        out[f"{mode}_bytes"] = b.get_usage().bytes_used
        out[f"{mode}_requests"] = sum(counted.calls.values())
        b.close()
    if out["listing_bytes"] != out["fleet_bytes"]:
        raise RuntimeError(f"the fleet's usage differs from the listing's: {out}")
    return out


def s3_target(work: Path) -> tuple[Callable[[str], tuple[dict[str, Any], ObjectStore]], Any]:
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store
    from kvbucket.testing.s3_server import SeaweedFS

    weed = SeaweedFS()
    server = weed.start()
    bucket = server.create_bucket()

    def make(prefix: str) -> tuple[dict[str, Any], ObjectStore]:
        cfg = server.config(bucket, prefix)
        return {"type": "s3", **cfg}, S3Store.from_config(S3Config(**server.config(bucket)))

    return make, weed.stop


def hub_target(work: Path) -> tuple[Callable[[str], tuple[dict[str, Any], ObjectStore]], Any]:
    from huggingface_hub import HfApi

    from kvbucket.stores.hub.config import HFBucketConfig
    from kvbucket.stores.hub.store import HFBucketStore
    from kvbucket.testing.hub_emulator import HubEmulator

    emu = HubEmulator(work / "data", {"bench": ("bench-token", "write")}, subprocess=True)
    emu.__enter__()
    HfApi(endpoint=emu.endpoint, token="bench-token").create_bucket("bench/fleet", private=True)

    def make(prefix: str) -> tuple[dict[str, Any], ObjectStore]:
        base = {"bucket_handle": "hf://buckets/bench/fleet", "token": "bench-token", "endpoint": emu.endpoint}
        spec = {"type": "hfbucket", **base, "bucket_handle": f"hf://buckets/bench/fleet/{prefix}"}
        return spec, HFBucketStore(HFBucketConfig(**base))

    return make, lambda: emu.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stores", default="s3,hub")
    ap.add_argument("--nodes", default="1,2,4,8")
    ap.add_argument("--parts", default="capacity,cost,startup")
    ap.add_argument("--rate", type=float, default=30.0, help="data requests per second per node (cost)")
    ap.add_argument("--cost-secs", type=float, default=75.0)
    ap.add_argument("--warm-secs", type=float, default=20.0, help="cost: counted from this second on")
    ap.add_argument("--chunk-kib", type=int, default=16, help="cost: KiB per chunk request")
    ap.add_argument("--sync-secs", type=float, default=5.0, help="the fleet's sync_secs in the cost part")
    ap.add_argument("--modes", default="clock,paced", help="cost: clock-driven and/or activity-paced")
    ap.add_argument("--ratio", type=float, default=0.01, help="cost: coordination_ratio when paced")
    ap.add_argument("--max-sync-secs", type=float, default=60.0, help="cost: max_sync_secs when paced")
    ap.add_argument("--startup-chunks", type=int, default=100_000)
    ap.add_argument("--hub-startup-chunks", type=int, default=10_000)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results import Results, add_argument

    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_fleet", params=vars(args),
                  title="A fleet on one prefix: capacity, coordination cost, warm start")
    parts = set(args.parts.split(","))
    nodes = [int(x) for x in args.nodes.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.stores.split(","):
            make, close = (s3_target if name == "s3" else hub_target)(Path(tmp) / name)
            try:
                if "capacity" in parts:
                    capacity_part(name, make, nodes, res)
                if "cost" in parts:
                    cost_part(name, make, nodes, args, res)
                k = args.startup_chunks if name == "s3" else args.hub_startup_chunks
                if "startup" in parts and k:
                    _, store = make("unused")
                    w = warm_start(store, f"warm-{uuid.uuid4().hex[:6]}", k)
                    print(f"warm start with {k} chunks: full listing {w['listing_requests']:.0f} requests "
                          f"{w['listing_secs']:.1f} s; fleet {w['fleet_requests']:.0f} requests "
                          f"{w['fleet_secs']:.1f} s; "
                          f"{w['listing_requests'] / w['fleet_requests']:.0f}x fewer requests", flush=True)
                    res.compare(f"{name} warm start", f"{name}: warm start with {k:,} chunks, requests",
                                ours=w["fleet_requests"], ours_name="fleet snapshot",
                                peer=w["listing_requests"], peer_name="full listing", unit="requests",
                                higher_is_better=False, goal=">= 10",
                                seconds=w["fleet_secs"], peer_seconds=w["listing_secs"])
                    store.close()
            finally:
                close()
    res.write(args.results_dir)


Maker = Callable[[str], tuple[dict[str, Any], ObjectStore]]


def capacity_part(name: str, make: Maker, nodes: list[int], res: Any) -> None:
    print(f"\n== {name}: capacity {CAPACITY // 1024} KiB, {CHUNK // 1024} KiB chunks, 3x written")
    print(f"{'N':>3} {'settled':>8} {'peak':>6} {'hot hits':>9} {'coord/node/min':>15} "
          f"{'data/node/min':>14} {'coord/data':>10} {'x-node evictions':>17} {'refused':>8}")
    for n in nodes:
        prefix = f"fleet-{n}-{uuid.uuid4().hex[:6]}"
        spec, store = make(prefix)
        r = fleet_run(spec, store, prefix, n)
        print(f"{n:>3} {r['settled']:>7.2f}x {r['peak']:>5.2f}x {r['hit_rate']:>8.0%} "
              f"{r['coord_per_min']:>15.0f} {r['data_per_min']:>14.0f} "
              f"{r['coord_per_min'] / r['data_per_min']:>9.1%} {r['cross_node_evictions']:>17} "
              f"{r['refused']:>8}", flush=True)
        res.run(part="capacity", store=name, nodes=n, **r)
        res.figure(f"{name} capacity {n}", r["settled"], "x capacity", peak=r["peak"], hit_rate=r["hit_rate"],
                   label=f"{name}: bytes held after settling, {n} node(s) (peak {r['peak']:.2f}x)",
                   goal="<= 1.1")
        store.close()


def cost_part(name: str, make: Maker, nodes: list[int], args: argparse.Namespace, res: Any) -> None:
    chunk = args.chunk_kib * 1024
    print(f"\n== {name}: cost, {args.rate:g} data requests/s per node (half stores, half loads), "
          f"{args.chunk_kib} KiB chunks, capacity {COST_CAPACITY_CHUNKS} chunks, counted from "
          f"{args.warm_secs:g} s to {args.cost_secs:g} s")
    print(f"{'mode':<55} {'N':>2} {'coord/node/min':>14} {'compactor':>9} {'other':>6} {'data/node/min':>13} "
          f"{'other/data':>10} {'fleet/data':>10} {'hot hits':>8} {'refused':>7}")
    modes = {"clock": {"sync_secs": args.sync_secs},
             "paced": {"sync_secs": args.sync_secs, "coordination_ratio": args.ratio,
                       "max_sync_secs": args.max_sync_secs}}
    for mode in args.modes.split(","):
        fleet = modes[mode]
        label = ", ".join(f"{k} {v:g}" for k, v in fleet.items())
        for n in nodes:
            spec, store = make(f"cost-{mode}-{n}-{uuid.uuid4().hex[:6]}")
            r = cost_run(spec, n, args.rate, args.cost_secs, fleet, chunk, args.warm_secs)
            print(f"{label:<55} {n:>2} {r['coord']:>14.1f} {r['compactor']:>9.1f} {r['other']:>6.1f} "
                  f"{r['data']:>13.0f} {r['other_ratio']:>10.2%} {r['fleet_ratio']:>10.2%} "
                  f"{r['hit_rate']:>8.0%} {r['refused']:>7}", flush=True)
            res.run(part="cost", store=name, mode=mode, nodes=n, **r)
            res.figure(f"{name} cost {mode} {n}", r["fleet_ratio"] * 100, "% of data requests",
                       label=f"{name}: coordination requests, {mode} ({label}), {n} nodes", goal="<= 1%")
            store.close()


if __name__ == "__main__":
    main()
