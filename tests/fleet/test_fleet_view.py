"""The fleet's folded view and eviction choice, as pure logic (no store, no threads)."""

from __future__ import annotations

import pytest

from kvbucket.errors import ConfigError
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import Journal, is_fleet_name, journal_name, parse_name, snapshot_name
from kvbucket.fleet.view import FleetView, owner
from kvbucket.keys import key_to_name, name_to_key
from kvbucket.l2 import EvictionConfig, parse_l2_config
from kvbucket.testing.fleet_node import key

P = "pre"


def seg(i: int, salt: str = "") -> str:
    return key_to_name(key(i, salt))


def test_last_writer_wins_whatever_the_arrival_order() -> None:
    a, b = FleetView(P), FleetView(P)
    recs = [("s", seg(1), 100, 10.0), ("d", seg(1), 0, 11.0), ("s", seg(1), 100, 9.0), ("s", seg(2), 50, 5.0)]
    a.apply_all("n1", recs)
    b.apply_all("n1", list(reversed(recs)))
    assert set(a.entries) == set(b.entries) == {f"{P}/{seg(2)}"}
    assert a.bytes_used == b.bytes_used == 50
    # A store newer than the delete brings the chunk back; applying it twice changes nothing.
    for _ in range(2):
        a.apply("n2", ("s", seg(1), 100, 12.0))
    assert a.bytes_used == 150 and a.entries[f"{P}/{seg(1)}"].writer == "n2"


def test_snapshot_round_trip_keeps_entries_tombstones_and_salts() -> None:
    v = FleetView(P)
    v.apply_all("n1", [("s", seg(1, "t1"), 10, 1.0), ("s", seg(2, "t2"), 20, 2.0), ("d", seg(3), 0, 3.0)])
    w = FleetView.from_body(v.to_body(), P)
    assert w.bytes_by_salt() == {"t1": 10, "t2": 20}
    assert w.tombs == v.tombs and not w.diff(v) and not v.diff(w)


def test_foreign_and_fleet_names_are_not_chunks() -> None:
    v = FleetView(P)
    assert v.apply("n", ("s", "not-a-key", 10, 1.0)) is None
    assert v.apply("n", ("s", "_fleet/j/n/1", 10, 1.0)) is None
    assert len(v) == 0
    name = journal_name(P, "n1", 7)
    assert is_fleet_name(name, P) and parse_name(name, P).seq == 7
    assert parse_name(snapshot_name(P, 3, "n2"), P).node == "n2"
    with pytest.raises(Exception):  # noqa: B017 - nested names are never keys
        name_to_key(name, P)


def test_journal_bytes_round_trip_and_refuse_other_objects() -> None:
    j = Journal("n1", 4, [("s", seg(1), 10, 1.5)])
    assert Journal.from_bytes(j.to_bytes()) == j
    with pytest.raises(ValueError):
        Journal.from_bytes(b"hello")


def _victims(v: FleetView, me: str, live: list[str], **kw: object) -> list[str]:
    args: dict = dict(capacity=1000, eviction=EvictionConfig(), now=100.0, grace=5.0, max_age=None,
                      pinned=(), busy=(), me=me, live=live)
    args.update(kw)
    return v.victims(**args)


def test_nodes_split_the_victims_without_overlap_and_cover_the_need() -> None:
    v = FleetView(P)
    v.apply_all("w", [("s", seg(i), 10, float(i)) for i in range(90)])  # 900 of 1000 >= 80%
    live = ["a", "b", "c"]
    parts = [_victims(v, n, live) for n in live]
    union = [x for p in parts for x in p]
    assert len(union) == len(set(union))
    assert sum(v.entries[x].size for x in union) >= 900 - 600  # down to the 60% target
    # Least recently used first: every victim is older than every survivor.
    newest_victim = max(v.entries[x].last_used for x in union)
    assert all(e.last_used >= newest_victim for n, e in v.entries.items() if n not in union)
    assert all(owner(x, live) == n for n, p in zip(live, parts, strict=True) for x in p)


def test_grace_pins_busy_and_max_age() -> None:
    v = FleetView(P)
    v.apply_all("w", [("s", seg(i), 10, 10.0) for i in range(50)])
    v.apply_all("w", [("s", seg(100 + i, "pin"), 10, 10.0) for i in range(50)])
    v.apply("w", ("s", seg(200), 10, 99.0))  # within grace
    busy = {f"{P}/{seg(0)}"}
    got = _victims(v, "a", ["a"], pinned={"pin"}, busy=busy)
    assert got and all(v.entries[x].salt != "pin" for x in got)
    assert f"{P}/{seg(0)}" not in got and f"{P}/{seg(200)}" not in got
    # Under capacity nothing goes, unless it is older than max_age.
    small = FleetView(P)
    small.apply_all("w", [("s", seg(1), 10, 10.0), ("s", seg(2), 10, 90.0), ("s", seg(3, "pin"), 10, 1.0)])
    assert _victims(small, "a", ["a"]) == []
    assert _victims(small, "a", ["a"], max_age=50.0, pinned={"pin"}) == [f"{P}/{seg(1)}"]


def test_fair_shares_take_from_the_salt_over_its_share() -> None:
    v = FleetView(P)
    v.apply_all("w", [("s", seg(i, "big"), 10, float(i)) for i in range(80)])
    v.apply_all("w", [("s", seg(i, "small"), 10, 0.0) for i in range(10)])  # older, but under share
    got = _victims(v, "a", ["a"])
    assert got and all(v.entries[x].salt == "big" for x in got)


def test_fleet_spec_is_strict() -> None:
    cfg = parse_l2_config({"type": "fs", "base_path": "/tmp/x", "fleet": {"sync_secs": 1.0}})
    assert cfg.fleet == FleetConfig(sync_secs=1.0)
    for bad in ({"sync_sec": 1.0}, {"node_id": "a/b"}, {"heartbeat_secs": 10.0, "node_timeout_secs": 5.0}):
        with pytest.raises(ConfigError, match="fleet"):
            parse_l2_config({"type": "fs", "base_path": "/tmp/x", "fleet": bad})


def test_late_access_hints_still_protect_a_chunk_read_elsewhere() -> None:
    """The hot-set race: far over capacity, eviction goes deep into the LRU order; a chunk
    another node read 3 s ago (grace 2 s) looks unused by wall clock if its hint arrived late,
    but the view's knowledge horizon (every hint up to 97 s is in) keeps it."""
    v = FleetView(P)
    v.apply_all("w", [("s", seg(i), 10, 80.0 + i * 0.1) for i in range(1, 101)])
    v.apply_all("w", [("s", seg(i), 10, 98.5 + i * 0.001) for i in range(200, 400)])  # in grace
    hot = f"{P}/{seg(0)}"
    v.apply_all("r", [("s", seg(0), 10, 10.0), ("a", seg(0), 0, 97.0)])  # read on node r at 97
    assert hot in _victims(v, "a", ["a"], grace=2.0)  # 3x capacity: everything out of grace goes
    got = _victims(v, "a", ["a"], grace=2.0, horizon=98.5)
    assert hot not in got and len(got) == 100


def test_digest_rows_rebuild_the_compactors_changes() -> None:
    base = FleetView(P)
    base.apply_all("w", [("s", seg(i), 10, 1.0) for i in range(5)])
    compactor = FleetView.from_body(base.to_body(), P)
    compactor.apply_all("w", [("s", seg(9, "t"), 20, 5.0), ("d", seg(1), 0, 6.0), ("a", seg(2), 0, 7.0)])
    reader = FleetView.from_body(base.to_body(), P)
    changes = reader.apply_delta(compactor.delta_body())
    assert sorted(changes, key=str) == sorted([(f"{P}/{seg(9, 't')}", 20), (f"{P}/{seg(1)}", None)], key=str)
    assert reader.bytes_by_salt() == compactor.bytes_by_salt() == {"": 40, "t": 20}
    assert reader.entries[f"{P}/{seg(2)}"].accessed == 7.0
    assert reader.apply_delta(compactor.delta_body()) == []  # idempotent


def test_pacing_settings_are_validated_with_what_to_fix() -> None:
    base = {"type": "fs", "base_path": "/tmp/x"}
    cfg = parse_l2_config({**base, "fleet": {"coordination_ratio": 0.01, "max_sync_secs": 40}}).fleet
    assert cfg is not None and cfg.stage_secs == 10 and cfg.idle_secs == 40 and cfg.visibility_secs == 40
    default = FleetConfig(coordination_ratio=0.01)
    assert default.visibility_secs == 60 and default.stage_secs == 15 and default.write_cap == 2.0
    assert FleetConfig().coordination_ratio is None and FleetConfig().stage_secs == 5  # clock-driven
    for bad, why in [
        ({"max_sync_secs": 30}, "max_sync_secs applies only with coordination_ratio"),
        ({"coordination_ratio": 0.01, "max_sync_secs": 10}, r"at least 4 \* sync_secs"),
        ({"coordination_ratio": 0.01, "max_sync_secs": 80}, "2/3 of node_timeout_secs"),
        ({"coordination_ratio": 0.01, "idle_sync_secs": 10}, r"max_sync_secs / 4"),
        ({"coordination_ratio": 0}, "coordination_ratio"),
        ({"coordination_ratio": 1.5}, "coordination_ratio"),
        ({"coordination_ratio": "0.01"}, "coordination_ratio"),  # strict JSON: a number
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_l2_config({**base, "fleet": bad})


def test_pacer_rounds_by_credit_within_the_stage_and_backs_off_when_idle() -> None:
    import threading
    import time

    from kvbucket.fleet.pacing import CREDIT_CAP, ROUND_COST, Pacer

    cfg = FleetConfig(sync_secs=0.05, coordination_ratio=0.1, max_sync_secs=40.0, idle_sync_secs=20.0,
                      node_timeout_secs=90.0)
    pace = Pacer(cfg, threading.Event())
    assert pace.interval == cfg.stage_secs == 10.0

    def waited(last: float) -> float:
        t0 = time.monotonic()
        assert not pace.wait(last)
        return time.monotonic() - t0

    # Not enough credit: the round waits (here cut short by earning the rest from another thread).
    pace.earn(int(ROUND_COST / 0.1) - 1)
    assert pace.credit < ROUND_COST
    timer = threading.Timer(0.2, pace.earn, args=(1,))
    timer.start()
    assert 0.15 < waited(time.monotonic()) < 2.0  # credit paid for the round, not the 10 s stage
    active = pace.begin_round()
    pace.spend(2)  # what the round cost by its counters (its journal's reads were prepaid)
    pace.spend(2)
    assert active and pace.credit == pytest.approx(0.0)
    pace.end_round(active=active, news=False, busy=False, compactor=False)
    assert pace.interval == 10.0
    # Credit is capped: a busy spell buys no flurry of rounds later, and debt is bounded too.
    pace.earn(10_000)
    assert pace.credit == CREDIT_CAP
    pace.spend(100)
    assert pace.credit == -CREDIT_CAP
    # A node that served nothing doubles its wait up to idle_sync_secs; the compactor keeps the stage.
    pace.begin_round()
    for want in (20.0, 20.0):
        pace.end_round(active=False, news=True, busy=False, compactor=False)  # digest news alone: idle
        assert pace.interval == want
    pace.end_round(active=False, news=False, busy=False, compactor=True)
    assert pace.interval == 10.0
    pace.end_round(active=False, news=False, busy=False, compactor=False)
    assert pace.interval == 20.0
    # Its first request after a long idle wait ends the wait once a stage has passed.
    last = time.monotonic() - 15.0
    threading.Timer(0.1, pace.earn, args=(1,)).start()
    assert waited(last) < 2.0
    # Clock-driven: news keeps sync_secs, no credit is kept.
    clock = Pacer(FleetConfig(sync_secs=0.05, idle_sync_secs=1.0), threading.Event())
    clock.earn(1000)
    assert clock.credit == 0.0
    clock.end_round(active=False, news=False, busy=False, compactor=False)
    assert clock.interval == 0.1
    clock.end_round(active=False, news=True, busy=False, compactor=False)
    assert clock.interval == 0.05


def test_every_fleet_member_takes_the_pacing_settings() -> None:
    """L2 adapters, LMCache's non-MP connector, the engine tiers and the storage backends' remote
    tier all parse the same FleetConfig and run the same Fleet thread (its Pacer)."""
    from kvbucket.backends.fleet import parse_fleet_settings
    from kvbucket.fleet.member import StoreFleet
    from kvbucket.integrations.engine_fleet import FleetSettings
    from kvbucket.integrations.lmcache import connector_config_from_extra
    from kvbucket.stores.local.memory import MemoryStore

    paced = {"coordination_ratio": 0.01, "max_sync_secs": 40.0}
    want = FleetConfig(**paced)
    assert parse_l2_config({"type": "fs", "base_path": "/tmp/x", "fleet": paced}).fleet == want
    conn = connector_config_from_extra({"remote_storage_plugin.kv.bucket_handle": "file:///tmp/x",
                                        "remote_storage_plugin.kv.fleet": paced}, "kv")
    assert conn.fleet == want
    tier = FleetSettings.model_validate({"fleet": paced})
    assert tier.fleet == want
    backend = parse_fleet_settings({"fleet": paced}, "")
    assert backend is not None and backend.fleet == want
    with pytest.raises(ConfigError, match="max_sync_secs"):
        parse_fleet_settings({"fleet": {"max_sync_secs": 40.0}}, "")
    store = MemoryStore("pace")
    member = StoreFleet(store, store, want, capacity=0, eviction=EvictionConfig(eviction_policy="noop"),
                        parse_key_string=lambda name: name)
    try:
        assert member.fleet._pace.ratio == 0.01 and member.fleet._pace.stage == 10.0
        member.stored(["a"], [1])
        member.accessed(["a", "b"])
        assert member.status()["data_requests"] == 3
    finally:
        member.close()
