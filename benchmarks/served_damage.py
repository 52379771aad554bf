"""The randomized served-bytes run with damage (issue 39), per store kind, to at least N loads.

Writers rewrite names, readers load them (lookups and read-ahead included) while objects are
damaged in storage, 10% of reads are damaged on the wire and evictions run by version
(:func:`kvbucket.testing.served_bytes.run_cell` with ``damage``); every found load is checked
against the write history and, after each round, every name whose last event was a good put must
still be stored. Prints one JSON line per store kind; ``timed_out`` counts the lookups, loads,
damage and evictions whose store call missed its deadline (misses: a starved machine shows
there, the run goes on) and ``store_failed`` those ended by another store error (breaker open).

    PYTHONPATH=src python benchmarks/served_damage.py --loads 10000 [--kinds file,hub,s3]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from delete_races import opener
from kvbucket.testing.served_bytes import Tally, run_cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=10_000)
    ap.add_argument("--kinds", default="file,hub,s3")
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--rounds", type=int, default=400, help="rounds per cell (cells run until --loads)")
    ap.add_argument("--wire", type=float, default=0.1, help="share of reads damaged on the wire")
    ap.add_argument("--chunk-kib", type=int, default=64)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # every refusal is logged otherwise
    for kind in args.kinds.split(","):
        total, cells, t0 = Tally(), 0, time.perf_counter()
        with opener(kind) as open_store:
            store = open_store()
            while total.loads < args.loads:
                total.add(run_cell(store, encrypted=cells % 2 == 1, read_ahead=True, rounds=args.rounds,
                                   seed=args.seed + cells, chunk_kib=args.chunk_kib, damage=args.wire,
                                   cell=f"{kind} cell {cells}"))
                cells += 1
            store.close()
        print(json.dumps({"kind": kind, "cells": cells, "loads": total.loads, "found": total.found,
                          "wrong_bytes_served": len(total.wrong),
                          "valid_chunks_deleted": len(total.valid_deleted),
                          "readded_by_writer_recheck": total.readded,
                          "damaged_at_rest": total.damaged, "wire_flipped": total.wire_flipped,
                          "evicted": total.evicted, "evictions_kept": total.evictions_kept,
                          "timed_out": total.timed_out, "store_failed": total.failed,
                          "secs": round(time.perf_counter() - t0, 1)}), flush=True)
        for line in (total.wrong + total.valid_deleted)[:5]:
            print("  " + line, flush=True)


if __name__ == "__main__":
    main()
