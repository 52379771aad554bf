"""The 3x-capacity fleet test on S3 (SeaweedFS) and on the Hub emulator: spawned processes,
one prefix, settle under 1.1x capacity, hot set kept, nodes evicting each other's chunks.

Smaller than the fs run (32 KiB chunks, a 1 MiB capacity, 2 MiB hot set excluded) so the
remote rounds stay within a few seconds each; timings as in test_fleet_processes.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbucket.keys import key_to_name
from kvbucket.l2 import open_l2_adapter
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing import l2 as t
from kvbucket.testing.fleet_node import check_paced, chunk, key, paced_fleet, run_fleet
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.s3_server import S3Server

CHUNK = 32 * 1024
CAPACITY = 1024 * 1024
FLEET = {"sync_secs": 0.3, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 1.0,
         "reconcile_secs": 3.0, "grace_secs": 1.0,
         # 3x capacity is written: a write cap of 1 refused most of it, and some runs then had no
         # eviction (and no cross-node eviction) to show; the cap has its own tests
         "write_cap": 3.0}
SETTLE = 5.0
HUB_RECHECK_DELAY = 2.5
HOT = list(range(1_000_000, 1_000_004))


def fleet_round(base: dict[str, Any], held: Any, settle: float = SETTLE) -> None:
    spec = {**base, "max_capacity_gb": CAPACITY / 1024**3, "full_chunk_bytes": CHUNK}
    seed = open_l2_adapter({**spec, "fleet": {**FLEET, "node_id": "seed"}})
    try:
        assert seed.wait_until_rebuilt(60)
        assert t.store(seed, [key(i) for i in HOT], [chunk(i, CHUNK) for i in HOT]).success
    finally:
        seed.close()
    per_node = CAPACITY // CHUNK
    plans = [{"name": f"n{i}", "start": i * 10_000, "count": per_node, "chunk": CHUNK, "batch": 4,
              "hot": HOT, "pause": 0.25, "linger": settle} for i in range(3)]
    specs = [{**spec, "fleet": {**FLEET, "node_id": p["name"]}} for p in plans]
    reports = run_fleet(specs, plans, timeout=180)
    sizes = held()
    total = sum(sizes.values())
    assert total <= 1.1 * CAPACITY, f"{total / CAPACITY:.2f}x capacity after settling"
    assert all(key_to_name(key(i)) in sizes for i in HOT), "the hot set was evicted"
    assert all(r["hot_hits"] == r["hot_reads"] > 0 for r in reports), [
        (r["node"], r["hot_hits"], r["hot_reads"], r["status"]["fleet"]) for r in reports]
    # Writes spread over more than the grace (pause 0.25 s): eviction, not only the write cap,
    # makes room, and nodes delete chunks other nodes wrote.
    print({r["node"]: (r["stored"], r["status"]["refused_full"], r["status"]["evicted_keys"],
                       r["status"]["fleet"]["evicted_cross_node"]) for r in reports})
    assert sum(r["status"]["fleet"]["evicted_cross_node"] for r in reports) > 0
    fleets = [r["status"]["fleet"] for r in reports]
    # One compactor lists and reads journals; the others read its digest (they list only while
    # there is no fresh digest yet, e.g. at the start), so their cost does not grow with N.
    readers = sorted(fleets, key=lambda f: f["digests_written"])[:-1]  # a node may lead a round at start
    assert all(f["digests_read"] > 0 for f in readers), [
        {k: f[k] for k in ("node", "digests_read", "digests_written", "listing_rounds")} for f in fleets]


def chunks_of(store: Any) -> dict[str, int]:
    with seal_store(store, tier="l2") as s:
        return {i.name: i.size for i in s.list("") if not i.name.startswith("_fleet/")}


def test_fleet_on_s3(seaweedfs: S3Server, s3_bucket: str) -> None:
    cfg = seaweedfs.config(s3_bucket, "kv")
    fleet_round({"type": "s3", **cfg}, lambda: chunks_of(S3Store.from_config(S3Config(**cfg))))


@pytest.mark.slow(17)
def test_fleet_on_the_hub_emulator(hub_bucket: HubBucket) -> None:
    handle = f"hf://buckets/{hub_bucket.bucket_id}/kv"
    # recheck_delay_secs 2.5, not the default 5 (the delete window stays at its default 2, as in
    # tests/integrity): the same rechecks, with 5 s less of the nodes' linger below.
    base = {"type": "hfbucket", "bucket_handle": handle, "token": hub_bucket.hub.write_token,
            "endpoint": hub_bucket.hub.endpoint, "recheck_delay_secs": HUB_RECHECK_DELAY}
    cfg = HFBucketConfig(bucket_handle=handle, token=base["token"], endpoint=base["endpoint"],
                         recheck_delay_secs=HUB_RECHECK_DELAY)
    # On the Hub no chunk younger than twice recheck_delay_secs is evicted (its writer would add
    # it back: stores/hub/rechecks.py), whatever grace_secs says: the last writes settle later.
    fleet_round(base, lambda: chunks_of(HFBucketStore(cfg)), settle=SETTLE + 2 * cfg.recheck_delay_secs)


#: Activity-paced (coordination_ratio) on the remote stores: a chunk visible within 8 s, at most
#: 5% of data requests spent on coordination once busy; rounds take longer there than on fs.
PACED = {"sync_secs": 0.5, "coordination_ratio": 0.05, "max_sync_secs": 8.0, "idle_sync_secs": 5.0,
         "heartbeat_secs": 2.5, "node_timeout_secs": 12.0, "compact_secs": 5.0, "reconcile_secs": 30.0,
         "grace_secs": 1.0}


@pytest.mark.slow(13)
def test_activity_paced_fleet_on_s3(seaweedfs: S3Server, s3_bucket: str) -> None:
    cfg = seaweedfs.config(s3_bucket, "paced")
    check_paced(paced_fleet({"type": "s3", **cfg}, PACED), PACED)


@pytest.mark.slow(15)
def test_activity_paced_fleet_on_the_hub_emulator(hub_bucket: HubBucket) -> None:
    base = {"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/paced",
            "token": hub_bucket.hub.write_token, "endpoint": hub_bucket.hub.endpoint}
    check_paced(paced_fleet(base, PACED, tick=0.2, store_every=1.0), PACED)
