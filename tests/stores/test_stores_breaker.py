"""The circuit breaker of remote stores: its state machine (closed -> open -> half-open -> closed,
a failed probe reopens it), what counts as a failure, and its state in metrics and
``kvbucket stats`` (the end-to-end cycles against real servers are in tests/hfbucket and
tests/s3 ``*_deadlines.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvbucket.errors import AuthError, CircuitOpenError, DeadlineExceededError, NotFoundError
from kvbucket.metrics import STORE_BREAKER_OPENS, start_metrics_server
from kvbucket.stores.base import ItemResult
from kvbucket.stores.guard.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, RemoteStore
from kvbucket.stores.local.memory import MemoryStore


class FlakyStore(RemoteStore):
    """A remote store whose every verb answers ``self.answer`` (a per-item error or None)."""

    def __init__(self, url: str, **breaker: float) -> None:
        self.url = url
        self.inner = MemoryStore(url)
        self.breaker = CircuitBreaker(url, **breaker)  # type: ignore[arg-type]
        self.error: Exception | None = None
        self.calls = 0

    def _answer(self, names: Sequence[str]) -> list[ItemResult]:
        self.calls += 1
        if isinstance(self.error, DeadlineExceededError | NotFoundError | AuthError):
            return [ItemResult(n, error=self.error) for n in names]  # type: ignore[arg-type]
        return [ItemResult(n) for n in names]

    def put_many(self, items):  # type: ignore[no-untyped-def]
        return self._answer([n for n, _ in items])

    def get_many(self, names, out=None):  # type: ignore[no-untyped-def]
        return self._answer(names)

    def head_many(self, names):  # type: ignore[no-untyped-def]
        return self._answer(names)

    def delete_many(self, names):  # type: ignore[no-untyped-def]
        return self._answer(names)

    def list(self, prefix="", *, page_size=1000):  # type: ignore[no-untyped-def]
        return iter(())


def test_opens_after_n_failures_half_opens_after_the_cooldown_and_closes_on_success() -> None:
    s = FlakyStore("flaky://a", failures=3, cooldown_secs=0.3)
    s.error = DeadlineExceededError("slow")
    for _ in range(2):
        s.head_many(["k"])
    assert s.breaker.state is CLOSED  # two failures are not three
    s.head_many(["k"])
    assert s.breaker.state is OPEN
    calls = s.calls
    for verb in (lambda: s.head_many(["k"]), lambda: s.get_many(["k"]), lambda: s.put_many([("k", b"v")]),
                 lambda: s.delete_many(["k"])):
        (r,) = verb()
        assert isinstance(r.error, CircuitOpenError) and "circuit breaker open" in str(r.error)
    assert s.calls == calls  # nothing reached the store
    time.sleep(0.35)
    s.error = None
    (r,) = s.head_many(["k"])  # the probe
    assert r.ok and s.breaker.state is CLOSED and s.calls == calls + 1


def test_a_failed_probe_reopens_and_only_one_probe_runs_at_a_time() -> None:
    s = FlakyStore("flaky://b", failures=1, cooldown_secs=0.2)
    s.error = DeadlineExceededError("slow")
    s.head_many(["k"])
    assert s.breaker.state is OPEN
    time.sleep(0.25)
    assert s.breaker.allow() and s.breaker.state is HALF_OPEN
    assert not s.breaker.allow()  # a second caller while the probe runs is refused
    s.breaker.record(True)
    assert s.breaker.state is OPEN
    assert STORE_BREAKER_OPENS.labels("flaky://b")._value.get() == 2


def test_answers_of_a_healthy_server_are_not_failures_and_zero_turns_it_off() -> None:
    s = FlakyStore("flaky://c", failures=1)
    for err in (NotFoundError("no bucket"), AuthError("bad token")):
        s.error = err
        s.head_many(["k"])
        assert s.breaker.state is CLOSED
    off = FlakyStore("flaky://d", failures=0)
    off.error = DeadlineExceededError("slow")
    for _ in range(20):
        off.head_many(["k"])
    assert off.breaker.state is CLOSED


def test_bad_arguments_raise_even_with_the_breaker_open() -> None:
    s = FlakyStore("flaky://e", failures=1, cooldown_secs=600)
    s.error = DeadlineExceededError("slow")
    s.head_many(["k"])
    with pytest.raises(ValueError, match="segment"):
        s.head_many(["../escape"])


def test_kvbucket_stats_shows_the_breaker_state() -> None:
    s = FlakyStore("flaky://stats-shown", failures=1, cooldown_secs=600)
    s.error = DeadlineExceededError("slow")
    s.head_many(["k"])
    s.put_many([("a", b"1"), ("b", b"2")])  # refused: counted
    with start_metrics_server(0) as server:
        out = subprocess.run(
            [sys.executable, "-m", "kvbucket", "stats", "--url", server.url],
            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
        )
    assert out.returncode == 0, out.stderr
    assert "circuit breaker of flaky://stats-shown: open; 2 objects refused while open" in out.stdout


class StuckStore(RemoteStore):
    """``head_many`` hangs until released (a client call nothing can cancel), then answers."""

    def __init__(self, **breaker: Any) -> None:
        self.url = "stuck://store"
        self.breaker = CircuitBreaker(self.url, **breaker)
        self.release = threading.Event()

    def head_many(self, names):  # type: ignore[no-untyped-def]
        self.release.wait(30)
        return [ItemResult(n, size=1) for n in names]

    def put_many(self, items):  # type: ignore[no-untyped-def]
        return [ItemResult(n) for n, _ in items]

    get_many = delete_many = head_many

    def list(self, prefix="", *, page_size=1000):  # type: ignore[no-untyped-def]
        return iter(())


def test_a_call_stuck_past_its_budget_opens_the_breaker_at_its_deadline_and_counts_once() -> None:
    s = StuckStore(failures=1, cooldown_secs=600, budgets={"head": 0.3}, grace_secs=0.1)
    stuck = threading.Thread(target=s.head_many, args=(["k"],), daemon=True)
    t0 = time.monotonic()
    stuck.start()
    while s.breaker.state is CLOSED and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert s.breaker.state is OPEN and stuck.is_alive()  # counted while its thread is still stuck
    assert 0.3 <= took < 1.5  # at budget + grace (was: only when the call ends, here never)
    t0 = time.monotonic()
    (r,) = s.head_many(["other"])
    # at once: well within the stuck call's budget (0.3 s), never waiting on the stuck store
    assert isinstance(r.error, CircuitOpenError) and time.monotonic() - t0 < 0.3
    s.release.set()
    stuck.join(5)
    assert not stuck.is_alive() and s.breaker.state is OPEN  # its late answer is not counted again
    s2 = StuckStore(failures=2, cooldown_secs=600, budgets={"head": 5.0})
    s2.release.set()
    assert s2.head_many(["k"])[0].ok and s2.breaker.state is CLOSED  # a call in budget: no effect



def _watcher(breaker: CircuitBreaker) -> threading.Thread:
    """The breaker's watch thread, once started (as a thread object: idents are reused)."""
    while breaker._watcher is None:
        time.sleep(0.01)
    t = breaker._watcher
    assert t in threading.enumerate() and t.name == "kvbucket-breaker-watch"
    return t


def test_close_ends_the_watchdog_at_once_with_a_call_stuck_or_none() -> None:
    """The watch thread outlived close() by up to the longest budget in flight plus the grace
    (issue 29 item 11), or by its idle time."""
    s = StuckStore(failures=1, cooldown_secs=600, budgets={"head": 600.0}, grace_secs=0.1)
    stuck = threading.Thread(target=s.head_many, args=(["k"],), daemon=True)
    stuck.start()
    watcher = _watcher(s.breaker)  # the call began: its watchdog waits for a 600 s budget
    s.breaker.close()
    assert not watcher.is_alive() and watcher not in threading.enumerate()  # gone when close() returns
    assert stuck.is_alive() and s.breaker.state is CLOSED  # the stuck call was not counted
    s.release.set()
    stuck.join(30)
    assert s.head_many(["k"])[0].ok
    assert s.breaker._watcher is None and s.breaker.state is CLOSED  # a call after close: none started

    idle = StuckStore(failures=1, budgets={"head": 600.0})
    idle.release.set()
    assert idle.head_many(["k"])[0].ok
    watcher = _watcher(idle.breaker)  # idle now: it would linger for its idle time
    idle.breaker.close()
    assert not watcher.is_alive()
