"""The no-hook refusal race of issue 39, per store kind: 0 valid rewrites lost.

A reader loads a damaged v1 of a name (it refuses it and removes it, by the rule of
docs/integrity.md) while a writer stores a valid v2 of that name at a random moment 0-4 ms after
the load starts; a trial loses v2 when the name does not hold v2 afterwards
(:func:`kvbucket.testing.delete_races.refusal_race`). ``--legacy`` replays the removal as it was
before versions (``delete_many`` of the name), to show the race the harness catches.

    PYTHONPATH=src python benchmarks/delete_races.py --trials 300 [--kinds file,hub,s3] [--legacy]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvbucket.stores.base import ObjectStore
from kvbucket.testing.delete_races import refusal_race

TOKEN = "hf_delete_races_write_token_0001"


@contextmanager
def opener(kind: str) -> Iterator[Callable[[], ObjectStore]]:
    """A factory of stores over one fresh place of ``kind``."""
    if kind == "file":
        from kvbucket.stores.local.file import FileStore

        with tempfile.TemporaryDirectory() as d:
            yield lambda: FileStore(d)
    elif kind == "hub":
        from kvbucket.stores.hub.config import HFBucketConfig
        from kvbucket.stores.hub.store import HFBucketStore
        from kvbucket.testing import HubEmulator

        with HubEmulator(tokens={"me": (TOKEN, "write")}) as emu:
            cfg = HFBucketConfig(bucket_handle="hf://buckets/me/races/kv", token=TOKEN, endpoint=emu.endpoint,
                                 create_bucket_if_missing=True, metadata_cache_ttl_secs=0)
            yield lambda: HFBucketStore(cfg)
    elif kind == "s3":
        from kvbucket.stores.s3.config import S3Config
        from kvbucket.stores.s3.store import S3Store
        from kvbucket.testing.s3_server import SeaweedFS

        with SeaweedFS() as srv:
            bucket = srv.create_bucket()
            yield lambda: S3Store(S3Config.parse(srv.config(bucket)))
    else:
        raise SystemExit(f"unknown store kind {kind!r}: file, hub or s3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--kinds", default="file,hub,s3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--legacy", action="store_true", help="remove by name, as before versions")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # one refusal per trial is logged otherwise
    if args.legacy:
        from kvbucket.stores.guard import refusals

        def by_name(self: refusals.Refusals, store: ObjectStore, drop: list[str], judge: object) -> dict:
            store.delete_many(drop)
            return {}

        refusals.Refusals._remove = by_name  # type: ignore[assignment,method-assign]
    for kind in args.kinds.split(","):
        with opener(kind) as open_raw:
            t0 = time.perf_counter()
            report = refusal_race(open_raw, args.trials, seed=args.seed)
            secs = time.perf_counter() - t0
        extra = {"lost_names": report.lost_names[:5]} if report.lost else {}
        if kind == "hub":  # the Hub writers' re-checks and the deleters' window, as counted
            from kvbucket.stores.hub.rechecks import HUB_DELETE_WINDOW, HUB_RECHECKS

            extra["rechecks"] = {o: int(HUB_RECHECKS.labels(o)._value.get())
                                 for o in ("kept", "newer", "readded", "damaged", "failed")}
            extra["delete_window"] = {o: int(HUB_DELETE_WINDOW.labels(o)._value.get())
                                      for o in ("recompared", "gave_up", "late")}
        print(json.dumps({"kind": kind, "legacy": args.legacy, **report.as_dict(), "secs": round(secs, 1),
                          **extra}))


if __name__ == "__main__":
    main()
