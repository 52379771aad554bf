"""What sealing costs a load, store by store: ``get_many`` into caller buffers, unsealed vs
sealed (verified) vs AES-256-GCM, on the same server, paired round by round.

    PYTHONPATH=src python benchmarks/bench_sealed.py [--backends fs,s3,hfbucket] [--kib 256] \\
        [--num-keys 32] [--rounds 120]

Each store holds ``num-keys`` objects of random bytes (distinct per store, so the Hub's chunk
dedup cannot serve one store from another's data). Every round loads all of them once through
each store, in alternating order; a round's three loads run back to back, so the per-round
ratios cancel the load drift of a shared machine. Prints the median and quartiles of those
ratios for wall time and for this process's CPU time (the servers run in their own processes).

This is the path every kvbucket tier takes (``SealedStore`` over the store, the caller's buffer
given), without an engine or LMCache's bench harness around it; ``bench_l2.py --integrity``
measures the same through LMCache's plugin, with more noise. "Unsealed" is
``benchmarks/unsealed.py``: the same stores without the envelope.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvbucket.encryption import Keyring
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.sealed import SealedStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Results, add_argument
from unsealed import Unsealed

KINDS = ("unsealed", "sealed", "aes")


@contextlib.contextmanager
def fs_stores(tmp: Path) -> Iterator[Callable[[str], ObjectStore]]:
    from kvbucket.stores.local.file import FileStore

    yield lambda kind: FileStore(tmp / kind)


@contextlib.contextmanager
def s3_stores(tmp: Path) -> Iterator[Callable[[str], ObjectStore]]:
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store
    from kvbucket.testing.s3_server import SeaweedFS

    weed = SeaweedFS()
    server = weed.start()
    try:
        bucket = server.create_bucket()
        # As bench_l2 configures kvbucket's s3 adapter: 64 requests at once, unsigned payloads.
        yield lambda kind: S3Store(S3Config(**server.config(bucket, kind, s3_num_io_threads=64,
                                                            s3_unsigned_payload=True)))
    finally:
        weed.stop()


@contextlib.contextmanager
def hub_stores(tmp: Path) -> Iterator[Callable[[str], ObjectStore]]:
    from kvbucket.stores import open_store
    from kvbucket.testing.hub_emulator import HubEmulator

    token = "hf_bench_" + os.urandom(8).hex()
    with HubEmulator(tokens={"bench": (token, "write")}, subprocess=True) as emu:
        os.environ.update({"HF_ENDPOINT": emu.endpoint, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"})
        yield lambda kind: open_store(f"hf://buckets/bench/sealed-{kind}", create_bucket_if_missing=True)


SERVERS = {"fs": fs_stores, "s3": s3_stores, "hfbucket": hub_stores}


def _paired(base: list[float], other: list[float]) -> str:
    ratios = [b / o for b, o in zip(base, other, strict=True) if o > 0]
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return f"{med:.3f} [{q1:.2f}-{q3:.2f}]"


def run(opener: Callable[[str], ObjectStore], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    ring = Keyring({"*": {1: os.urandom(32)}})
    stores: dict[str, ObjectStore] = {
        "unsealed": Unsealed(opener("unsealed")),
        "sealed": SealedStore(opener("sealed"), tier="bench"),
        "aes": SealedStore(opener("aes"), tier="bench", keyring=ring),
    }
    size = args.kib * 1024
    names = [f"bench@1@0@{i:x}@bfloat16" for i in range(args.num_keys)]
    payloads = {}
    for j, (kind, store) in enumerate(stores.items()):
        rng = np.random.default_rng(j)
        payloads[kind] = [rng.integers(0, 256, size, dtype=np.uint8) for _ in names]
        for r in store.put_many(list(zip(names, payloads[kind], strict=True))):
            if r.error is not None:
                raise SystemExit(f"{kind}: put failed: {r.error}")
    outs = [np.empty(size, dtype=np.uint8) for _ in names]
    wall: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    for rnd in range(args.rounds + 1):  # + 1 warmup
        for kind in KINDS if rnd % 2 == 0 else KINDS[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            results = stores[kind].get_many(names, outs)
            t1, c1 = time.perf_counter(), time.process_time()
            if not all(r.found for r in results) or not np.array_equal(outs[-1], payloads[kind][-1]):
                raise SystemExit(f"{kind}: a load missed or returned other bytes")
            if rnd:
                wall[kind].append(t1 - t0)
                cpu[kind].append(c1 - c0)
    for store in stores.values():
        store.close()
    return {"wall": wall, "cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="fs,s3,hfbucket")
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--num-keys", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=120)
    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_sealed", params=vars(args),
                  title="What sealing and AES-256-GCM cost a load (get_many into caller buffers)")
    print(f"get_many of {args.num_keys} x {args.kib} KiB into caller buffers, {args.rounds} rounds; "
          "throughput ratios per round: median [quartiles]")
    print(f"{'backend':<9} {'ms/round unsealed':>18} {'sealed/unsealed':>17} {'aes/sealed':>17} "
          f"{'CPU ms unsealed':>16} {'CPU sealed/unsealed':>20} {'CPU aes/sealed':>17}")
    with tempfile.TemporaryDirectory(prefix="kvbucket-bench-sealed-") as tmp:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            with SERVERS[backend](Path(tmp)) as opener:
                m = run(opener, args)
            w, c = m["wall"], m["cpu"]
            print(f"{backend:<9} {statistics.median(w['unsealed']) * 1e3:>18.2f} "
                  f"{_paired(w['unsealed'], w['sealed']):>17} {_paired(w['sealed'], w['aes']):>17} "
                  f"{statistics.median(c['unsealed']) * 1e3:>16.2f} "
                  f"{_paired(c['unsealed'], c['sealed']):>20} "
                  f"{_paired(c['sealed'], c['aes']):>17}",
                  flush=True)
            nbytes = args.num_keys * args.kib * 1024 / 2**20
            for ours, peer, what in (("sealed", "unsealed", "verified"), ("aes", "sealed", "AES-256-GCM")):
                res.compare(f"{backend} {ours}", f"{backend} load, {what} ({args.num_keys} x {args.kib} KiB)",
                            ours=nbytes / statistics.median(w[ours]), ours_name=ours,
                            peer=nbytes / statistics.median(w[peer]), peer_name=peer, unit="MiB/s",
                            goal=">= 0.95" if ours == "sealed" else ">= 0.8",
                            ratios=[b / t for b, t in zip(w[peer], w[ours], strict=True) if t > 0])
            for i in range(len(w["sealed"])):
                res.run(backend=backend, round=i + 1, **{f"{k} wall_s": w[k][i] for k in KINDS},
                        **{f"{k} cpu_s": c[k][i] for k in KINDS})
    res.write(args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
