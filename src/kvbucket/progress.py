"""Progress of long work: a bar on a terminal, a line every few seconds anywhere else.

A bar redrawn in place means nothing in a pipe or a CI log, and a log that stays silent for
minutes looks hung. So :class:`Progress` looks at its stream once: on a terminal it draws a rich
bar (transient); anywhere else it writes one plain line when the step changes
(:meth:`Progress.describe`) and one every ``$KVBUCKET_PROGRESS_INTERVAL`` seconds (default 5)
while the work runs. Work shorter than the interval writes nothing. Lines go to stderr by
default, so a command's stdout (its table or JSON) stays clean.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

INTERVAL_ENV = "KVBUCKET_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0


def interval_s() -> float:
    """Seconds between two progress lines (``$KVBUCKET_PROGRESS_INTERVAL``, at least 0.05)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        return max(0.05, float(raw)) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f} {unit}" if unit else f"{n:,.0f}"
    size = float(n)
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or u == "TiB":
            return f"{size:.0f} B" if u == "B" else f"{size:.1f} {u}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class Progress:
    """``advance(n)`` / ``update(n)`` (tqdm's name), ``describe(text)``, ``close()``; a context manager.

    ``total`` may be unknown (None); ``unit`` is ``"B"`` (shown in KiB/MiB/GiB) or a word
    ("objects", "steps"). ``enabled=False`` shows nothing (the library's default: only commands
    report progress). ``console`` is the rich console a bar is drawn on (default: stderr's)."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "B", *, enabled: bool = True,
                 stream: TextIO | None = None, console: Any = None) -> None:
        self.desc = desc
        self.total = total
        self.unit = unit
        self.done = 0.0
        self._stream = stream or sys.stderr
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: Any = None
        self._ticker: threading.Thread | None = None
        self.lines = 0  # lines written (line mode)
        if not enabled:
            return
        if _isatty(self._stream):
            self._start_bar(console)
        else:
            self._ticker = threading.Thread(target=self._tick, name="kvbucket-progress", daemon=True)
            self._ticker.start()

    # ---- the two faces ----------------------------------------------------------------
    def _start_bar(self, console: Any) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
        columns.append(TextColumn("{task.fields[amount]}"))
        columns.append(TimeElapsedColumn())
        self._bar = RichProgress(*columns, console=console or Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.desc, total=self.total, amount=self._amounts())

    def _tick(self) -> None:
        every = interval_s()
        while not self._stop.wait(every):
            self._line(periodic=True)

    def _amounts(self) -> str:
        if self.total is None:
            return _amount(self.done, self.unit)
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        done = _amount(self.done, self.unit) if self.unit == "B" else f"{self.done:,.0f}"
        return f"{done} of {_amount(self.total, self.unit)}{pct}"

    def _line(self, note: str = "", *, periodic: bool = False) -> None:
        with self._lock:
            # A tick that woke just before close() may reach the lock after close's "(done)" line:
            # it writes nothing then, so "(done)" stays the last line (seen in CI).
            if periodic and self._stop.is_set():
                return
            text = f"{self.desc}: {self._amounts()}, {time.monotonic() - self._t0:.0f} s{note}"
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # the reader has gone: keep working, stop talking
                self._stop.set()
            self.lines += 1

    # ---- what the work calls ------------------------------------------------------------
    def advance(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, advance=n, amount=self._amounts())

    update = advance  # tqdm's spelling (compile_cache's transfers call update)

    def describe(self, text: str, advance: float = 0) -> None:
        """A new step: shown at once (a line in a log, the bar's label on a terminal)."""
        self.desc = text
        self.done += advance
        if self._bar is not None:
            self._bar.update(self._task, description=text, advance=advance, amount=self._amounts())
        elif self._ticker is not None:
            self._line()

    def close(self, note: str = " (done)") -> None:
        """Stop; in line mode a last line ending with ``note`` (" (interrupted)" when it did not end)."""
        if self._stop.is_set() and self._bar is None:
            return
        self._stop.set()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._ticker is not None and self.lines:
            self._line(note)  # a log that said "working" also says it ended

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["DEFAULT_INTERVAL_S", "INTERVAL_ENV", "Progress", "interval_s"]
