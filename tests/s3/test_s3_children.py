"""Servers started by tests and benchmarks die with the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbucket.testing.children import dies_with_parent

STARTER = textwrap.dedent(
    """
    import sys, time
    from kvbucket.testing.s3_server import SeaweedFS
    from kvbucket.testing.hub_emulator import HubEmulator
    weed = SeaweedFS(); weed.start()
    emu = HubEmulator(subprocess=True); emu.__enter__()
    print(weed.proc.pid, emu.pid, flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_servers_die_when_their_starter_is_killed(tmp_path: Path) -> None:
    # TMPDIR: the servers' temp dirs, which the killed starter cannot remove, land in tmp_path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)}
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert starter.stdout is not None
        pids = [int(p) for p in starter.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        starter.send_signal(signal.SIGKILL)  # no cleanup code runs in the starter
        starter.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:  # do not leave them behind even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not survivors


def test_off_linux_the_command_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert dies_with_parent(["weed", "mini"]) == ["weed", "mini"]
