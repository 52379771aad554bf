"""Log an error once with a count, not once per chunk, per tier and per retry.

A missing bucket or a dead endpoint fails every chunk of every batch the same way; logging
each failure buries the one line that matters under hundreds of copies. :class:`RepeatedLog`
logs the first occurrence of a message as usual, counts the identical ones that follow, and
logs the count when the window is over, at :meth:`RepeatedLog.flush` (the tiers call it on
close) or at interpreter exit.

Messages are identical when they are equal once the per-item part (a chunk key, a task id),
passed as ``item``, is taken out: ``get of <key> from <url> failed: <error>`` for 300 keys is
one message with a count of 300.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

_ALL: weakref.WeakSet[RepeatedLog] = weakref.WeakSet()


@dataclass
class _Seen:
    text: str  # the message with the item taken out
    first: float  # when the window started
    repeats: int = 0


class RepeatedLog:
    """A logger front that logs identical messages once per ``window_s`` with a count."""

    def __init__(self, logger: logging.Logger, window_s: float = 60.0, max_kinds: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.window_s = window_s
        self.max_kinds = max_kinds
        self._clock = clock
        self._seen: OrderedDict[tuple[int, str], _Seen] = OrderedDict()
        self._lock = threading.Lock()
        _ALL.add(self)

    def log(self, level: int, msg: str, *args: object, item: object = None, same: str | None = None) -> None:
        """Log ``msg % args`` now if it is new (or its window is over), else count it.

        ``item`` is the per-item part to leave out when comparing; ``same`` replaces the
        comparison text altogether (messages with per-call counts in them).
        """
        if not self.logger.isEnabledFor(level):
            return
        text = msg % args if args else msg
        ident = same if same is not None else text.replace(str(item), "…") if item is not None else text
        now = self._clock()
        emit: list[str] = []
        with self._lock:
            seen = self._seen.get((level, ident))
            if seen is None:
                self._seen[(level, ident)] = _Seen(ident, now)
                emit.append(text)
                while len(self._seen) > self.max_kinds:  # forget the oldest kind, with its count
                    _, old = self._seen.popitem(last=False)
                    if old.repeats:
                        emit.append(self._summary(old, now))
            else:
                seen.repeats += 1
                if now - seen.first >= self.window_s:
                    emit.append(self._summary(seen, now))
                    seen.first, seen.repeats = now, 0
        for line in emit:
            self.logger.log(level, "%s", line)

    def warning(self, msg: str, *args: object, item: object = None, same: str | None = None) -> None:
        self.log(logging.WARNING, msg, *args, item=item, same=same)

    def error(self, msg: str, *args: object, item: object = None, same: str | None = None) -> None:
        self.log(logging.ERROR, msg, *args, item=item, same=same)

    def flush(self) -> None:
        """Log the counts not yet logged; forget every message (the next one is logged again)."""
        now = self._clock()
        with self._lock:
            pending = [(level, self._summary(s, now)) for (level, _), s in self._seen.items() if s.repeats]
            self._seen.clear()
        for level, line in pending:
            self.logger.log(level, "%s", line)

    @staticmethod
    def _summary(seen: _Seen, now: float) -> str:
        times = "time" if seen.repeats == 1 else "times"
        return f"{seen.text} (repeated {seen.repeats} more {times} in {max(now - seen.first, 0.0):.0f} s)"


@atexit.register
def flush_all() -> None:
    """Log every pending count (at interpreter exit; tests call it too)."""
    for r in list(_ALL):
        r.flush()


__all__ = ["RepeatedLog", "flush_all"]
