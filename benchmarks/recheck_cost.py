"""What a Hub writer's re-check costs (stores/hub/rechecks.py): a steady writer, re-check on and off.

A writer stores ``--objects`` objects of ``--kib`` KiB per ``put_many`` back to back for
``--secs`` seconds (longer than ``recheck_delay_secs``, so the checks run while it writes), then
closes the store (close runs the checks still pending). Sides alternate each round, each on a
fresh store over one emulator (in a child process). Per side: objects stored per second, the
requests the server saw per put batch (paths-info and batch commits), and how long close took.

    PYTHONPATH=src python benchmarks/recheck_cost.py [--secs 12] [--objects 16] [--kib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing import HubEmulator

TOKEN = "hf_recheck_cost_write_token_0001"


def routes(emu: HubEmulator) -> dict[str, int]:
    return {k: int(v.get("requests", 0)) for k, v in emu.stats()["routes"].items()}


def one_side(emu: HubEmulator, delay: float, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/me/cost/{tag}", token=TOKEN, endpoint=emu.endpoint,
                         create_bucket_if_missing=True, recheck_delay_secs=delay)
    store = HFBucketStore(cfg)
    store.put("warm", b"x")  # the bucket, the write token, the first upload commit
    before = routes(emu)
    batches = stored = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.secs:
        items = [(f"b{batches}/o{i}", os.urandom(args.kib << 10)) for i in range(args.objects)]
        stored += sum(r.ok for r in store.put_many(items))
        batches += 1
    secs = time.perf_counter() - t0
    c0 = time.perf_counter()
    store.close()
    close_secs = time.perf_counter() - c0
    after = routes(emu)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    paths_info = sum(v for k, v in delta.items() if k == "paths_info")
    commits = sum(v for k, v in delta.items() if k == "batch")
    return {"objects_per_s": stored / secs, "batches": batches, "paths_info": paths_info,
            "commits": commits, "close_s": close_secs, "routes": delta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--secs", type=float, default=12.0)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=HFBucketConfig.model_fields["recheck_delay_secs"].default)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    out: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with HubEmulator(tokens={"me": (TOKEN, "write")}) as emu:
        for r in range(args.rounds):
            for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                res = one_side(emu, args.delay if side == "on" else 0.0, args, f"{side}{r}")
                out[side].append(res)
                brief = {k: v for k, v in res.items() if k != "routes"}
                print(json.dumps({"round": r, "side": side, **brief}), flush=True)
    for side, rs in out.items():
        n = sum(x["batches"] for x in rs)
        print(json.dumps({
            "side": side, "recheck_delay_secs": args.delay if side == "on" else 0,
            "objects_per_s_median": round(statistics.median(x["objects_per_s"] for x in rs), 1),
            "paths_info_per_batch": round(sum(x["paths_info"] for x in rs) / n, 3),
            "commits_per_batch": round(sum(x["commits"] for x in rs) / n, 3),
            "close_s_median": round(statistics.median(x["close_s"] for x in rs), 3),
            "routes_last_round": rs[-1]["routes"]}))


if __name__ == "__main__":
    main()
