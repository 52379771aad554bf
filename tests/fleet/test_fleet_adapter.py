"""Fleet-mode adapters in one process on one shared store: visibility, warm start, TTL, status."""

from __future__ import annotations

import time

from kvbucket.fleet.config import FleetConfig
from kvbucket.keys import key_to_name
from kvbucket.l2 import EvictionConfig, ObjectStoreL2Adapter
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing import l2 as t
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.fleet_node import chunk, key, until

CHUNK = 1024
FAST = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 0.5,
        "grace_secs": 0.0}


def node(store, name: str, capacity: int = 0, **fleet: object) -> ObjectStoreL2Adapter:
    cfg = FleetConfig(node_id=name, **{**FAST, **fleet})
    eviction = EvictionConfig() if capacity else None
    return ObjectStoreL2Adapter(store, owns_store=False, full_chunk_bytes=CHUNK, max_capacity_bytes=capacity,
                                eviction=eviction, fleet=cfg)




def test_a_chunk_stored_on_one_node_is_a_hit_on_another_without_heads() -> None:
    shared = MemoryStore("fleet")
    a, b_store = node(shared, "a"), CountingStore(shared)
    b = node(b_store, "b")
    try:
        assert a.wait_until_rebuilt(10) and b.wait_until_rebuilt(10)
        keys = [key(i) for i in range(5)]
        assert t.store(a, keys, [chunk(i, CHUNK) for i in range(5)]).success
        assert t.lookup(b, keys) == [False] * 5  # not yet known: a miss, never a wrong hit
        assert until(lambda: b.get_usage().bytes_used == 5 * CHUNK)  # within about 2 * sync_secs
        hits = t.lookup(b, [*keys, key(99)])
        assert hits == [True] * 5 + [False]
        bufs = [bytearray(CHUNK) for _ in keys]
        assert t.load(b, keys, bufs) == [True] * 5 and bufs[3] == chunk(3, CHUNK)
        b.submit_unlock(keys)
        assert b_store.calls["head_many"] == 0
        # Deletes travel the same way.
        assert a.delete(keys[:2]) == [True, True]
        assert until(lambda: b.get_usage().bytes_used == 3 * CHUNK)
        assert t.lookup(b, keys[:2]) == [False, False]
        fleet = b.report_status()["fleet"]
        assert set(fleet["live_nodes"]) == {"a", "b"} and fleet["remote_deletes_seen"] == 2
    finally:
        a.close()
        b.close()


def test_warm_start_reads_a_snapshot_not_a_listing() -> None:
    shared = MemoryStore("warm")
    n = 30_000  # bench_fleet.py measures 100,000
    names = [key_to_name(key(i)) for i in range(n)]
    shared.put_many([(nm, b"x" * 16) for nm in names])
    a = ObjectStoreL2Adapter(shared, owns_store=False, full_chunk_bytes=16,
                             fleet=FleetConfig(node_id="a", **FAST))
    try:
        assert a.wait_until_rebuilt(60)  # no snapshot yet: a adopts the listing, then compacts
        assert until(lambda: a.report_status()["fleet"]["snapshots_written"] >= 1, 60)
        counted = CountingStore(shared)
        t0 = time.monotonic()
        b = ObjectStoreL2Adapter(counted, owns_store=False, full_chunk_bytes=16,
                                 fleet=FleetConfig(node_id="b", **{**FAST, "sync_secs": 60.0}))
        try:
            assert b.wait_until_rebuilt(60)
            took = time.monotonic() - t0
            usage = b.get_usage()
            assert usage.complete and usage.bytes_used == 16 * n
            requests = sum(counted.calls.values())
            listing_pages = n // 1000
            assert requests * 10 <= listing_pages, dict(counted.calls)
            assert t.lookup(b, [key(5), key(n + 5)]) == [True, False]
            b.submit_unlock([key(5)])
            print(f"warm start: {requests} requests vs {listing_pages} listing pages, {took:.2f} s")
        finally:
            b.close()
    finally:
        a.close()


def test_max_age_is_enforced_by_any_node_and_counted_as_cross_node() -> None:
    shared = MemoryStore("ttl")
    a, b = node(shared, "a", max_age_secs=1.0), node(shared, "b", max_age_secs=1.0)
    try:
        assert a.wait_until_rebuilt(10) and b.wait_until_rebuilt(10)
        keys = [key(i) for i in range(40)]
        assert t.store(a, keys, [chunk(i, CHUNK) for i in range(40)]).success
        assert until(lambda: not any(True for _ in shared.list("")
                                     if not _.name.startswith("_fleet/")))
        assert until(lambda: b.get_usage().bytes_used == 0 and a.get_usage().bytes_used == 0)
        assert b.report_status()["fleet"]["evicted_cross_node"] > 0  # b removed chunks a wrote
    finally:
        a.close()
        b.close()


def test_lmcache_format_names_are_shared_too(tmp_path) -> None:
    from kvbucket.l2.naming import Naming
    from kvbucket.stores.local.file import FileStore

    shared = FileStore(tmp_path / "kv")
    nodes = [ObjectStoreL2Adapter(shared, owns_store=False, full_chunk_bytes=CHUNK,
                                  naming=Naming(style="fs", object_format="lmcache"),
                                  fleet=FleetConfig(node_id=n, **FAST)) for n in ("a", "b")]
    a, b = nodes
    try:
        assert a.wait_until_rebuilt(10) and b.wait_until_rebuilt(10)
        keys = [key(i, "t") for i in range(3)]
        assert t.store(a, keys, [chunk(i, CHUNK) for i in range(3)]).success
        assert any(i.name.endswith(".data") for i in shared.list(""))  # LMCache's fs names
        assert until(lambda: b.get_usage().bytes_used == 3 * CHUNK)
        assert b.get_usage().bytes_by_cache_salt == {"t": 3 * CHUNK}
        assert t.lookup(b, keys) == [True] * 3
        b.submit_unlock(keys)
    finally:
        for n in nodes:
            n.close()
        shared.close()


def test_an_idle_node_backs_off_and_its_next_store_brings_it_back() -> None:
    shared = MemoryStore("idle")
    a = node(shared, "a", idle_sync_secs=0.8, heartbeat_secs=1.0)  # the compactor ("a" < "b")
    b = node(shared, "b", idle_sync_secs=0.8, heartbeat_secs=1.0)  # keeps sync_secs
    try:
        assert a.wait_until_rebuilt(10) and b.wait_until_rebuilt(10)
        assert until(lambda: b.report_status()["fleet"]["sync_interval_secs"] == 0.8)
        before = b.report_status()["fleet"]["coordination_requests"]
        time.sleep(2.0)
        idle = b.report_status()["fleet"]["coordination_requests"] - before
        assert idle <= 6, idle  # 2-3 digest GETs and 2 heartbeats, not 20 rounds of 0.1 s
        assert t.store(b, [key(1)], [chunk(1, CHUNK)]).success
        assert until(lambda: a.get_usage().bytes_used == CHUNK, 5)
        assert b.report_status()["fleet"]["sync_interval_secs"] < 0.8
        status = a.report_status()["fleet"]
        assert status["compactor"] and status["sync_interval_secs"] == 0.1
    finally:
        a.close()
        b.close()
