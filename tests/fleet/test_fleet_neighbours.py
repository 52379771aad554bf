"""Nodes that disagree (issue 24 items 14, 15, 16): capacities and clocks are warned once, a
node whose clock is an hour ahead neither declares the others dead nor becomes a second
compactor, and a failure that persists is logged once with a count, not every round. Fleet
members are driven round by round (``sync_once``) on real stores."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvbucket.keys import key_to_name
from kvbucket.log_once import flush_all
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.fleet_node import key, until
from kvbucket.testing.fleet_rounds import CHUNK, P, member, open_store, rounds, stored


def warnings(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and text in r.getMessage()]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_nodes_with_different_capacities_are_warned_once_naming_both(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvbucket.fleet.peers")
    store = open_store(kind, request, tmp_path)
    small, big = member(store, "n0", 8 * CHUNK), member(store, "n1", 16 * CHUNK)
    try:
        for i in range(6):  # each round: a journal with news from both, a digest from n0
            stored(store, small, range(i, i + 1))
            stored(store, big, range(100 + i, 101 + i))
            rounds(small, big, n=1)
        said = warnings(caplog, "kvbucket.fleet.peers", "max_capacity_gb")
        # One line on each node (the compactor reads n1's journals, n1 the compactor's digest).
        assert len(said) == 2, said
        for line in said:
            assert f"{8 * CHUNK / 1024**3:g}" in line and f"{16 * CHUNK / 1024**3:g}" in line, line
        assert small.status()["sync_errors"] == big.status()["sync_errors"] == 0
    finally:
        small.close()
        big.close()
        store.close()


HOUR = 3600.0


@pytest.mark.parametrize("kind", ["file", "hub"])
def test_a_node_an_hour_ahead_sees_the_others_alive_and_does_not_compact(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """n1's wall clock is an hour ahead (records, journals and its reading of the others' times;
    its monotonic clock is its own, as on a real host). It used to see every other node's
    heartbeat an hour old, call them dead and compact too. On the Hub its objects' mtimes are its
    own clock's, as kvbucket writes them. S3 refuses requests signed more than 15 minutes off, so
    there is no S3 case."""
    caplog.set_level(logging.WARNING, "kvbucket.fleet.peers")
    store = open_store(kind, request, tmp_path)
    real = time.time
    n0, n1, n2 = member(store, "n0"), member(store, "n1"), member(store, "n2")

    def ahead(fn: Any, *args: Any) -> Any:
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() + HOUR)
            return fn(*args)

    try:
        for i in range(10):
            if i < 8:  # then two rounds for the last journals to reach every node
                stored(store, n0, range(i, i + 1))
                ahead(stored, store, n1, range(100 + i, 101 + i))
                stored(store, n2, range(200 + i, 201 + i))
            n0.sync_once()
            ahead(n1.sync_once)
            n2.sync_once()
            time.sleep(0.05)
        s1 = ahead(n1.status)
        assert s1["live_nodes"] == ["n0", "n1", "n2"], s1["nodes"]
        assert not s1["compactor"] and s1["snapshots_written"] == s1["digests_written"] == 0, s1
        assert s1["digests_read"] > 0  # it reads the compactor's digest like any other node
        s0, s2 = n0.status(), n2.status()
        assert s0["compactor"] and s0["live_nodes"] == s2["live_nodes"] == ["n0", "n1", "n2"]
        assert s2["snapshots_written"] == 0  # n1's fast clock did not make n0 look dead to n2 either
        assert s1["chunks"] == s0["chunks"] == 24
        # Warned once each: n0 (reading n1's journals) and n1 (reading n0's digest).
        ahead_lines = warnings(caplog, "kvbucket.fleet.peers", "n1's clock is about")
        behind_lines = warnings(caplog, "kvbucket.fleet.peers", "n0's clock is about")
        assert len(ahead_lines) == 1 and "ahead of this node's (n0)" in ahead_lines[0], ahead_lines
        assert len(behind_lines) == 1 and "behind this node's (n1)" in behind_lines[0], behind_lines
        assert not warnings(caplog, "kvbucket.fleet.peers", "n2's clock")
    finally:
        n0.close()
        ahead(n1.close)
        n2.close()
        store.close()


def test_a_failure_that_persists_is_logged_once_then_counted(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Every round fails the same way (a file stands where the fleet's directory should be, so
    no journal can be written): one line, and the count when the window closes (flush)."""
    caplog.set_level(logging.WARNING, "kvbucket.fleet.sync")
    store = FileStore(tmp_path / "kv")
    store.put(f"{P}/_fleet", b"not a directory")
    fleet = member(store, "n0", sync_secs=0.02)
    names = [f"{P}/{key_to_name(key(i))}" for i in range(3)]
    fleet.start()
    try:
        assert fleet.wait_ready(10)
        fleet.note_stored(names, [CHUNK] * 3)
        assert until(lambda: fleet.status()["sync_errors"] >= 20, 30.0)
        lines = warnings(caplog, "kvbucket.fleet.sync", "fleet sync failed on node n0")
        assert len(lines) == 1 and "cannot be a directory" in lines[0], lines
        assert "cannot be a directory" in fleet.status()["last_error"]
    finally:
        fleet.close(timeout=5)
        store.close()
    flush_all()
    counted = warnings(caplog, "kvbucket.fleet.sync", "repeated")
    assert len(counted) == 1 and "fleet sync failed on node n0" in counted[0], counted


def test_du_from_outside_shows_a_fleet_that_stopped_as_having_no_live_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvbucket du`` looks once and has no history of anyone's progress: it judges the digest
    and the listing by its own clock (display only), so a fleet whose nodes all stopped longer
    than node_timeout_secs ago shows its chunks and no live node."""
    from kvbucket.fleet.report import inspect_fleet

    store = FileStore(tmp_path / "kv")
    n0, n1 = member(store, "n0"), member(store, "n1")
    try:
        stored(store, n0, range(3))
        stored(store, n1, range(10, 12))
        rounds(n0, n1, n=3)
    finally:
        n0.close()
        n1.close()
    now = inspect_fleet(store, P)
    assert now is not None and now["chunks"] == 5 and now["live_nodes"] == ["n0", "n1"], now
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 100.0)  # du's default node_timeout_secs: 90
    later = inspect_fleet(store, P)
    assert later is not None and later["chunks"] == 5 and later["live_nodes"] == [], later
    store.close()


def test_one_late_write_is_not_a_clock_behind(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 40's soak: after an outage a node warned that another's clock was 95 s behind, all
    three on one machine: a journal whose put retried through the outage landed with an old
    stamp. One late object is not a skew; two in a row are; a stamp ahead is at once."""
    from kvbucket.fleet.peers import Peers

    caplog.set_level(logging.WARNING, "kvbucket.fleet.peers")
    p = Peers("n0", 0, 30.0, "test")
    now = time.time()
    p.clock_of("n1", now - 95, now - 5, now)  # one journal stamped before the outage, landed after
    p.clock_of("n1", now + 1, now - 1, now + 2)  # the next: on time
    p.clock_of("n1", now - 95, now - 5, now)  # another late one, not in a row
    assert not warnings(caplog, "kvbucket.fleet.peers", "n1's clock")
    p.clock_of("n1", now - 96, now - 5, now)  # two in a row: the clock is behind
    lines = warnings(caplog, "kvbucket.fleet.peers", "n1's clock")
    assert len(lines) == 1 and "behind this node's (n0)" in lines[0], lines
    p.clock_of("n2", now + 3600, now - 5, now)  # ahead: told at once
    lines = warnings(caplog, "kvbucket.fleet.peers", "n2's clock")
    assert len(lines) == 1 and "ahead of this node's (n0)" in lines[0], lines
