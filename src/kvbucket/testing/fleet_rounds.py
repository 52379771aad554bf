"""Fleet members driven round by round (``Fleet.sync_once``, no thread) on a real store, for the
tests of what the fleet does with what it reads (tests/fleet/test_fleet_untrusted.py,
test_fleet_neighbours.py): a directory, S3 (the ``seaweedfs`` and ``s3_bucket`` fixtures) or the Hub
emulator (``hub_bucket``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.keys import key_to_name
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.fleet_node import key

P = "kv"
CHUNK = 1000
FAST = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 0.3,
        "reconcile_secs": 600.0, "grace_secs": 0.0, "write_cap": None}
GARBAGE = b"not a fleet!\n"  # 13 bytes, as in the issue


def open_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if kind == "file":
        return FileStore(tmp_path / "kv")
    if kind == "s3":
        from kvbucket.stores.s3.config import S3Config
        from kvbucket.stores.s3.store import S3Store

        server, bucket = request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket")
        return S3Store.from_config(S3Config(**server.config(bucket)))
    from kvbucket.stores.hub.config import HFBucketConfig
    from kvbucket.stores.hub.store import HFBucketStore

    hub = request.getfixturevalue("hub_bucket")
    # No writer re-check (stores/hub/rechecks.py): with it, the fleet evicts no chunk younger than
    # twice its delay, and these rounds evict what they stored a moment before.
    return HFBucketStore(HFBucketConfig(bucket_handle=f"hf://buckets/{hub.bucket_id}",
                                        token=hub.hub.write_token, endpoint=hub.hub.endpoint,
                                        recheck_delay_secs=0))


def member(store: ObjectStore, name: str, capacity: int = 10 * CHUNK, **fleet: Any) -> Fleet:
    return Fleet(store, FleetConfig(node_id=name, **{**FAST, **fleet}), prefix=P, capacity=capacity,
                 eviction=EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2))


def stored(store: ObjectStore, fleet: Fleet, ids: range) -> list[str]:
    names = [f"{P}/{key_to_name(key(i))}" for i in ids]
    assert all(r.ok for r in store.put_many([(n, b"x" * CHUNK) for n in names]))
    fleet.note_stored(names, [CHUNK] * len(names))
    return names


def rounds(*fleets: Fleet, n: int = 3) -> None:
    """``n`` rounds of every member; a round that raises fails the test."""
    for _ in range(n):
        for f in fleets:
            f.sync_once()


__all__ = ["CHUNK", "FAST", "GARBAGE", "P", "member", "open_store", "rounds", "stored"]
