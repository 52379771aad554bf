"""kvbucket.progress: a line per step and every few seconds when not on a terminal, nothing when off.

The ticker's timing is not asserted (the machine is loaded); steps are written at once, so a
step's line is checked without waiting. The installed script's lines in a log are checked in
test_cli_conventions.py (listings slowed by the emulator's latency rule).
"""

from __future__ import annotations

import io

import pytest

from kvbucket.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV, Progress, interval_s


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_each_step_is_a_line_at_once_in_a_log() -> None:
    out = _Pipe()
    with Progress("starting", total=3, unit="steps", stream=out) as p:
        p.describe("machine A: building the model", advance=1)
        p.describe("machine B: answering", advance=1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("machine A: building the model: 1 of 3 steps (33%), ")
    assert lines[1].startswith("machine B: answering: 2 of 3 steps (67%), ")
    assert lines[-1].endswith(" (done)")


def test_bytes_are_shown_in_binary_units() -> None:
    out = _Pipe()
    with Progress("verifying", total=3 << 30, stream=out) as p:
        p.advance(1 << 30)
        p.describe("verifying")
    assert out.getvalue().startswith("verifying: 1.0 GiB of 3.0 GiB (33%), ")


def test_short_work_and_disabled_progress_write_nothing() -> None:
    out = _Pipe()
    with Progress("listing", unit="objects", stream=out) as p:
        p.advance(10)
    assert out.getvalue() == ""  # ended before the first tick: no "(done)" for nothing
    with Progress("listing", unit="objects", stream=out, enabled=False) as p:
        p.describe("a step")
    assert out.getvalue() == ""


def test_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_s() == 0.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    assert interval_s() == DEFAULT_INTERVAL_S
    monkeypatch.delenv(INTERVAL_ENV)
    assert interval_s() == DEFAULT_INTERVAL_S


def test_a_tick_that_reaches_the_lock_after_close_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ticker wakes, then waits for the lock while close() stops it: its line would follow
    "(done)" (seen once in CI: a listing's log ended on "3 objects, 2 s")."""
    import time

    monkeypatch.setenv(INTERVAL_ENV, "0.05")
    out = _Pipe()
    p = Progress("listing", unit="objects", stream=out)
    assert p._ticker is not None
    with p._lock:
        time.sleep(0.3)  # the ticker woke (every 0.05 s) and now waits for the lock
        p._stop.set()  # what close() does first
        written = out.getvalue()
    p._ticker.join(5)
    assert not p._ticker.is_alive()
    assert out.getvalue() == written  # nothing after the stop
