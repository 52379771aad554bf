"""Server processes that die with the process that started them, so a test run or benchmark
killed mid-way (SIGKILL, a CI timeout) leaves no SeaweedFS or emulator behind.

Linux's ``PR_SET_PDEATHSIG`` is set by a tiny launcher that then ``exec``s the real program, so
the child's PID is the server's and stopping it by PID still works. The signal follows the
*thread* that started the child, so start servers from a thread that outlives them (the main
thread, as the fixtures and benchmarks do). Elsewhere than Linux the command runs unchanged.
"""

from __future__ import annotations

import os
import sys

_LAUNCHER = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("kvbucket.testing: the process that started this server is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dies_with_parent(argv: list[str]) -> list[str]:
    """``argv`` wrapped so the program gets SIGTERM when this process dies."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv]
