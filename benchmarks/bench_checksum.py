"""Payload checksums for the chunk envelope, measured on this machine.

    PYTHONPATH=src python benchmarks/bench_checksum.py [--mib 2] [--repeat 7]

Hashes one ``--mib`` MiB buffer (a KV chunk's size) with each candidate and prints GiB/s and the
ratio to a ``memcpy`` of the same buffer measured in the same run (the envelope's checksum runs
once per load, after the bytes landed, so it competes with memory bandwidth). Candidates:
xxh3-64 (``xxhash``), crc32c (``google-crc32c``; it accepts only read-only exporters
such as ``bytes``, so a caller's writable buffer costs a copy first: both figures are
printed), blake3 single-threaded (``blake3``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument


def _rate(fn: Callable[[], object], nbytes: int, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt > 0.2:
                break
        runs.append(n * nbytes / dt / 2**30)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=7)
    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_checksum", params=vars(args), title="Checksums of a KV chunk against memcpy")
    size = int(args.mib * 2**20)
    buf = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(buf)
    view = memoryview(buf)
    as_bytes = bytes(view)  # google-crc32c takes only read-only exporters such as bytes
    cases: dict[str, Callable[[], object]] = {"memcpy": lambda: np.copyto(dst, buf)}
    try:
        import xxhash

        cases["xxh3_64 (xxhash)"] = lambda: xxhash.xxh3_64_intdigest(view)
    except ImportError:
        print("xxhash not installed: skipped")
    import blake3
    import google_crc32c

    # Measured on bytes (its best case): a caller's numpy/torch buffer would need a copy first.
    cases["crc32c (google-crc32c)"] = lambda: google_crc32c.value(as_bytes)
    cases["crc32c incl. the copy"] = lambda: google_crc32c.value(bytes(view))
    cases["blake3 (1 thread)"] = lambda: blake3.blake3(view).digest()
    rates = {name: _rate(fn, size, args.repeat) for name, fn in cases.items()}
    base = rates["memcpy"]
    print(f"{'case':<24} {'GiB/s':>8} {'vs memcpy':>10}   ({args.mib:g} MiB buffer, median of {args.repeat})")
    for name, r in rates.items():
        print(f"{name:<24} {r:8.2f} {r / base:10.2f}")
        if name != "memcpy":
            res.compare(name, f"{name}, {args.mib:g} MiB", ours=r, ours_name=name, peer=base,
                        peer_name="memcpy", unit="GiB/s")
    res.write(args.results_dir)


if __name__ == "__main__":
    main()
