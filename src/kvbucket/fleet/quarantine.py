"""Fleet objects judged bad: skipped until they change, counted, logged once.

A stray file under ``_fleet/`` (see :mod:`.wire`) must not cost a read and a decompression every
round, nor a log line every round. A :class:`Quarantine` remembers each bad object by name with
what identifies its version (its size for journals and snapshots, which are written once; the
store's tag for the digest, which is overwritten): a listed object with the same identity is
skipped without a request; a new version is read again (the compactor overwrites a bad digest).
Nothing is deleted here: the compactor's usual rules remove old journals and snapshots.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable

from kvbucket.log_once import RepeatedLog

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)

#: Bad objects remembered at most (the oldest is forgotten first, and read again if still there).
MAX_REMEMBERED = 4096


class Quarantine:
    def __init__(self, node: str) -> None:
        self.node = node
        self.count = 0  # objects judged bad (each version once)
        self._bad: OrderedDict[str, Hashable] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, name: str, ident: Hashable | None) -> bool:
        """Whether this version of ``name`` (None: any version) was judged bad already: skip it."""
        with self._lock:
            return name in self._bad and (ident is None or self._bad[name] == ident)

    def judge(self, name: str, ident: Hashable, why: object) -> None:
        """``name`` (this version) is bad: remember, count, log (once per kind of fault)."""
        with self._lock:
            if self._bad.get(name, object()) == ident:
                return
            self._bad[name] = ident
            self._bad.move_to_end(name)
            while len(self._bad) > MAX_REMEMBERED:
                self._bad.popitem(last=False)
            self.count += 1
        _repeated.warning("fleet node %s skips %s, which is not a fleet object it can read (%s); it "
                          "is skipped until it changes", self.node, name, why, item=name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._bad.pop(name, None)


__all__ = ["MAX_REMEMBERED", "Quarantine"]
