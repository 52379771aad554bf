"""Parse turns (``read_slots``): at most n fetched bodies parsed at once, and a turn is held only
while its body's next bytes are already here.

Why: parsing a body (socket reads into the window, chunk decoding, copies) is CPU work under the
GIL; 64 threads doing it at once hand the GIL around more than they work (a cold 64 x 2 MiB hit
on loopback: 38,000 voluntary context switches and 0.8 s of CPU, against 0.27 s for the same
hit parsed a few at a time). The turn used to be held for a whole body, so over a link that
caps each connection a holder waited on its slow socket while other bodies sat unread (their
TCP windows do not grow while nobody reads), which is why ``read_slots`` was off by default.

**Invariant (no turn is held across a wait for the network).** :meth:`Turn.before_read` gives
the turn up when the socket has nothing waiting, so the read that follows may block without
holding one; :meth:`Turn.take` takes it back before the bytes are parsed. A turn only ever
bounds CPU work on bytes already received (tests/hfbucket/test_hfbucket_xet_reads.py checks a
body trickling on one connection does not hold up the others).
"""

from __future__ import annotations

import threading

from kvbucket.stores.deadline import left
from kvbucket.stores.sockets import bytes_waiting


class Turns:
    """The reader's ``read_slots`` turns (a semaphore); :meth:`turn` is one fetch's."""

    def __init__(self, n: int) -> None:
        self._sem = threading.Semaphore(n)

    def turn(self, deadline: float) -> Turn:
        return Turn(self._sem, deadline)


class Turn:
    """One fetch's turn to parse: taken before parsing, given up before a read that would wait."""

    __slots__ = ("deadline", "held", "sem")

    def __init__(self, sem: threading.Semaphore, deadline: float) -> None:
        self.sem, self.deadline, self.held = sem, deadline, False

    def take(self) -> None:
        """Hold the turn (waiting for one, never past the deadline)."""
        if not self.held:
            if not self.sem.acquire(timeout=max(0.001, left(self.deadline))):
                raise TimeoutError("no read slot before the deadline")
            self.held = True

    def before_read(self, fd: int) -> None:
        """Give the turn up before the next read on ``fd`` (it may wait for the network)."""
        if self.held:
            self.held = False
            self.sem.release()

    def end(self) -> None:
        if self.held:
            self.held = False
            self.sem.release()


__all__ = ["Turn", "Turns"]
