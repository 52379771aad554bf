"""Benchmark helper (bench_ceiling): what a phase cost this process, per thread, and the rest of the box.

- :class:`GilMeter`: GIL-held seconds of this process, from ``py-spy record --gil --nonblocking``
  attached for the block only (why py-spy and not a spin-probe thread: bench_ceiling's docstring).
- :class:`CpuMeter`: CPU seconds of each of this process's threads and their run-queue waits
  (``/proc/self/task/<tid>/schedstat``: nanoseconds on a core, nanoseconds runnable but waiting for
  one), the server's CPU (its process and every descendant: ``/proc/<pid>/stat``, clock ticks) and
  the whole machine's busy cores (``/proc/stat``), all over the same interval. So a phase says how
  many threads did its work and their shares, how many cores the client and the server used, and
  whether the box was saturated (client + server + the rest ~ every core): a client held below one
  core by a busy box is told apart from a client that cannot use more than one.
  A thread that ended inside the block is not listed (its time is in the process's total, which
  ``measure`` takes from ``getrusage``): kvbucket's read threads and the peers' pools live on.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
PYSPY_RATE = 250
#: How long ``py-spy record`` may take to attach before the phase runs without a GIL meter.
ATTACH_TIMEOUT_S = 10.0
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: A thread is listed when it ran at least this share of the phase's thread CPU.
LISTED_SHARE = 0.02


def pyspy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class GilMeter:
    """GIL-held seconds of this process while the block runs, from ``py-spy record --gil``."""

    def __init__(self, rate: int = PYSPY_RATE) -> None:
        self.rate = rate
        self.seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out = ""

    def __enter__(self) -> GilMeter:
        exe = pyspy()
        if exe is None:
            return self
        fd, self._out = tempfile.mkstemp(prefix="ceiling-gil-", suffix=".txt")
        os.close(fd)
        self._proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--gil", "--nonblocking", "--rate", str(self.rate),
             "--format", "raw", "-o", self._out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if not _sampling(self._proc, ATTACH_TIMEOUT_S):
            self._proc.kill()
            self._proc.communicate()
            self._proc = None
        return self

    def __exit__(self, *exc: Any) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return
        samples = 0
        with open(self._out, encoding="utf-8", errors="replace") as f:
            for line in f:
                head, _, n = line.rstrip().rpartition(" ")
                if head and n.isdigit():
                    samples += int(n)
        os.unlink(self._out)
        self.seconds = samples / self.rate


def _sampling(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``py-spy record`` attached: it prints its "Sampling process ..." line once it has
    read the interpreter's state, right before its first sample (a fixed sleep of 0.6 s waited
    here before; the line comes within ~40 ms on an idle box). False if it ended or stayed silent."""
    assert proc.stdout is not None
    fd, seen, end = proc.stdout.fileno(), b"", time.monotonic() + timeout
    poll = select.poll()  # not select(): a process with over 1,024 descriptors open (the peers'
    poll.register(fd, select.POLLIN)  # runtimes, one per thread) failed with "fd out of range"
    while b"\n" not in seen:
        left = end - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            return False
        chunk = os.read(fd, 4096)  # the raw pipe: nothing left in a Python buffer for communicate()
        if not chunk:
            return False  # py-spy ended (no ptrace rights, ...)
        seen += chunk
    time.sleep(2 / PYSPY_RATE)  # its first sample taken
    return proc.poll() is None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:  # a thread or process that ended between the listing and the read
        return None


def thread_times() -> dict[int, tuple[float, float]]:
    """This process's live threads: tid -> (seconds on a core, seconds waiting in the run queue)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        text = _read(f"/proc/self/task/{tid}/schedstat")
        if text:
            run, wait = text.split()[:2]
            out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def thread_name(tid: int) -> str:
    """The Python name of a Python thread, else the kernel's (``comm``: Rust, C threads)."""
    for t in threading.enumerate():
        if t.native_id == tid:
            return "main" if t is threading.main_thread() else t.name
    return (_read(f"/proc/self/task/{tid}/comm") or "?").strip() or "?"


def tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid`` and its descendants, from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        text = _read(f"/proc/{entry}/stat")
        if not text:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    if pid not in cpu:
        return None
    family, grew = {pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in family} - family
        grew = bool(more)
        family |= more
    return sum(cpu[p] for p in family)


def box_busy() -> tuple[float, float, int]:
    """The machine's (busy, total) CPU seconds since boot, summed over its cores, and the number of
    cores ``/proc/stat`` lists (``(0, 0, 0)`` where it cannot be read)."""
    lines = (_read("/proc/stat") or "").splitlines()
    if not lines or not lines[0].startswith("cpu "):
        return 0.0, 0.0, 0
    vals = [int(x) for x in lines[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already in user
    cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
    return (total - idle) / TICK, total / TICK, cores


def box_cores(before: tuple[float, float, int], after: tuple[float, float, int]) -> float | None:
    """Busy cores of the machine between two :func:`box_busy` readings, or None when it cannot be
    told: ``/proc/stat`` counts in ticks (10 ms per core), so a phase shorter than a tick of the
    whole machine reads 0 of 0 (seen on CI: a warm 4 MiB load), and a box without it reads nothing.
    """
    busy, span, cores = after[0] - before[0], after[1] - before[1], after[2]
    if span <= 0 or cores <= 0:
        return None
    return busy / span * cores  # busy share of every core over the interval, times the core count


class CpuMeter:
    """Per-thread CPU and run-queue waits of this process, the server's CPU and the box's, for a block."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.result: dict[str, Any] = {}

    def __enter__(self) -> CpuMeter:
        self._t0, self._box0 = thread_times(), box_busy()
        self._srv0 = tree_cpu(self.server_pid) if self.server_pid else None
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._w0
        t1, box1 = thread_times(), box_busy()
        srv1 = tree_cpu(self.server_pid) if self.server_pid else None
        ran = {tid: (run - self._t0.get(tid, (0.0, 0.0))[0], wait - self._t0.get(tid, (0.0, 0.0))[1])
               for tid, (run, wait) in t1.items()}
        total = sum(r for r, _ in ran.values())
        listed = sorted(((thread_name(tid), r, w) for tid, (r, w) in ran.items()
                         if total > 0 and r >= LISTED_SHARE * total), key=lambda x: -x[1])
        self.result = {
            "threads": [{"name": n, "cpu_s": round(r, 4), "share": round(r / total, 3),
                         "runq_wait_s": round(w, 4)} for n, r, w in listed],
            "busy_threads": len(listed),
            "runq_wait_s": sum(w for _, w in ran.values()),
            "server_cores": ((srv1 - self._srv0) / wall) if srv1 is not None and self._srv0 is not None
            and wall > 0 else None,
            "box_cores": box_cores(self._box0, box1), "box_cpus": box1[2] or os.cpu_count() or 1}


def measure(fn: Callable[[], Any], nbytes: int, server_pid: int | None = None) -> dict[str, Any]:
    """Wall, client CPU and GIL-held seconds of ``fn()``, per GiB of ``nbytes``, with the threads
    that did the work (:class:`CpuMeter`)."""
    with GilMeter() as gil, CpuMeter(server_pid) as threads:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    gib = nbytes / GIB
    held = None if gil.seconds is None else gil.seconds / gib
    return {"result": out, "wall_s": wall, "gibs": gib / wall if wall > 0 else None,
            "cores": cpu / wall if wall > 0 else None, "cpu_s_per_gib": cpu / gib, "gil_s_per_gib": held,
            "ceiling_gibs": (1 / held) if held else None, **threads.result}
