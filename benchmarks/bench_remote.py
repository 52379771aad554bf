"""Pipelined vs plain remote reads over a store with network-like latency, in the same run.

    PYTHONPATH=src python benchmarks/bench_remote.py [--chunks 64] [--chunk-mib 2] [--rtt-ms 5]

The store is a FileStore whose every call first waits ``--rtt-ms`` (a round trip to a remote
server). ``RemoteBackend.batched_get`` makes one ``get_many`` call for the whole batch, as a
store without parallel fetches would serve it one object at a time; ``PipelinedRemoteBackend``
fetches sub-batches on several threads while decoding the ones that arrived. Each case reads
the same chunks; the table gives GiB/s and the ratio to the plain backend.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.stores.base import Buffer, ItemResult
from kvbucket.stores.local.file import FileStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument

MIB = 1024 * 1024


class LatencyStore(FileStore):
    """A FileStore whose reads pay one round trip per object, as an HTTP GET would."""

    rtt = 0.005

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        time.sleep(self.rtt * len(names))
        return super().get_many(names, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--rtt-ms", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=5)
    add_argument(ap)
    args = ap.parse_args(argv)
    res = Results("bench_remote", params=vars(args),
                  title="Pipelined remote reads against plain remote reads, a store with per-object latency")
    size = int(args.chunk_mib * MIB)
    layout = KVLayout(1, 1, 1, "uint8", chunk_tokens=size // 2)
    LatencyStore.rtt = args.rtt_ms / 1000
    root = Path(tempfile.mkdtemp(prefix="kvbucket-bench-remote-"))
    try:
        store = LatencyStore(root)
        rng = np.random.default_rng(0)
        keys = [f"bench@1@0@{i:x}@uint8" for i in range(args.chunks)]
        data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in keys]
        cases = {
            "RemoteBackend": RemoteBackend(store, layout, owns_store=False),
            "PipelinedRemoteBackend": PipelinedRemoteBackend(store, layout, owns_store=False, io_threads=4,
                                                             pipeline_batch=4, max_inflight=8),
        }
        cases["RemoteBackend"].batched_put(list(zip(keys, data, strict=True)))
        secs: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(args.repeat):
            for name, backend in cases.items() if rep % 2 == 0 else reversed(cases.items()):
                t0 = time.perf_counter()
                got = backend.batched_get(keys)
                secs[name].append(time.perf_counter() - t0)
                if any(g is None or bytes(g) != d.tobytes() for g, d in zip(got, data, strict=True)):
                    raise SystemExit(f"{name}: bytes read back differ")
        for b in cases.values():
            b.close()
        total = args.chunks * size
        base = statistics.median(secs["RemoteBackend"])
        print(f"{args.chunks} chunks x {args.chunk_mib:g} MiB, {args.rtt_ms:g} ms per object, median of "
              f"{args.repeat}")
        print(f"{'case':<26} {'get GiB/s':>10} {'ratio':>8}")
        for name, s in secs.items():
            m = statistics.median(s)
            print(f"{name:<26} {total / m / 2**30:>10.2f} {base / m:>8.2f}")
            for i, t in enumerate(s):
                res.run(case=name, repetition=i, get_gibs=total / t / 2**30)
        piped = secs["PipelinedRemoteBackend"]
        shape = f"{args.chunks} x {args.chunk_mib:g} MiB, {args.rtt_ms:g} ms per object"
        res.compare("get", f"batched_get ({shape})",
                    ours=total / statistics.median(piped) / 2**30, ours_name="PipelinedRemoteBackend",
                    peer=total / base / 2**30, peer_name="RemoteBackend", unit="GiB/s",
                    ratios=[b / t for b, t in zip(secs["RemoteBackend"], piped, strict=True)])
        res.write(args.results_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
