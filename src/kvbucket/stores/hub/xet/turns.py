"""Parse turns (``read_slots``): at most n fetched bodies parsed at once, a turn held only while
its body's bytes are already here.

Why: parsing a body (socket reads into the window, chunk decoding, copies) is CPU work, under
the GIL while the pure-Python decoder is in use (a fresh process's first hits). 64 threads doing
it at once hand the GIL around more than they work: a cold 64 x 2 MiB hit on loopback made
38,000 voluntary context switches and took 0.8 s of CPU, against 0.3 s parsed four at a time
(docs/hfbucket.md, "Parse turns"). A turn held for a whole body (what ``read_slots`` was until
issue 41) cost 13-32% over a link that caps each connection: a holder waited on its slow
socket while the other bodies sat unread, which is why it was off by default.

**Invariant (no turn is held across a wait for the network).** :meth:`Turn.read_into` is the one
place a body's reader reads while it may hold a turn. With enough bytes already received (by
the socket's count; over TLS, only bytes already decrypted) it keeps the turn and reads at most those,
so the read returns at once; otherwise it gives the turn up, reads (and waits) without it, and
takes a turn again before the bytes are parsed. Threads without a turn so either wait for the
network or park on the semaphore, never parse. tests/hfbucket/test_hfbucket_xet_turns.py checks
that a body trickling on one connection does not hold up the others, and counts the turns.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl

from kvbucket.stores.deadline import left
from kvbucket.stores.sockets import waiting_count
from kvbucket.threads import ForkSafeSemaphore

#: Turns while chunks are decoded by the pure-Python decoder (GIL-bound: more parse no faster).
PYTHON_TURNS = 4
#: A turn-holder reads on only when at least this much is here (or all its chunk needs, or the
#: window's room): a smaller read parses no more per turn taken (half the 256 KiB window;
#: measured: on an 8 MB/s link every read was a few KiB and the load took 0.2 s more CPU).
MIN_READ = 128 << 10
def default_slots() -> int:
    """``read_slots``' default: one turn per core this process may run on, at least 4 (the
    compiled decoder runs without the GIL, so each core can parse one body)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(PYTHON_TURNS, cores)


class Turns:
    """The reader's ``read_slots`` turns: ``n`` while the compiled decoder is used, at most
    :data:`PYTHON_TURNS` of them while the Python one is; :meth:`turn` is one fetch's."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._compiled = ForkSafeSemaphore(n)  # a child forked while turns are held gets them all
        self._python = ForkSafeSemaphore(min(n, PYTHON_TURNS))

    def turn(self, deadline: float, resp: http.client.HTTPResponse, sock: socket.socket | None,
             compiled: bool) -> Turn:
        """The turn (not yet held) of one fetch answered by ``resp`` on ``sock``; ``compiled``:
        its chunks are decoded by the compiled decoder."""
        return Turn(self._compiled if compiled else self._python, deadline, resp, sock)


class Turn:
    """One fetch's turn to parse: taken before parsing, given up before a read that would wait."""

    __slots__ = ("deadline", "fd", "held", "resp", "sem", "tls")

    def __init__(self, sem: ForkSafeSemaphore, deadline: float, resp: http.client.HTTPResponse,
                 sock: socket.socket | None) -> None:
        self.sem, self.deadline, self.held, self.resp = sem, deadline, False, resp
        # A body sent in chunks carries framing the socket's count does not tell apart: nothing
        # is counted as here, every read is made without the turn.
        self.fd = sock.fileno() if sock is not None and not resp.chunked else -1
        self.tls = sock if isinstance(sock, ssl.SSLSocket) else None

    def take(self) -> None:
        """Hold the turn (waiting for one, never past the deadline)."""
        if not self.held:
            if not self.sem.acquire(timeout=max(0.001, left(self.deadline))):
                raise TimeoutError("no read slot before the deadline")
            self.held = True

    def read_into(self, mv: memoryview, need: int) -> int:
        """Read body bytes into ``mv`` as ``resp.readinto`` does (``need``: what the chunk being
        parsed still lacks), the turn held when this returns (the invariant above)."""
        here = self._here()
        if here < min(len(mv), max(need, MIN_READ)):
            self.give_up()
            k = self.resp.readinto(mv)  # may wait for the network: without the turn
            self.take()
            return k
        return self.resp.readinto(mv[:here])  # all here already: returns at once

    def _here(self) -> int:
        """Body bytes surely readable without waiting, by the socket's count (0: unknown)."""
        if self.fd < 0:
            return 0
        if self.tls is not None:
            # Over TLS the socket holds records, and no count of them bounds the body bytes they
            # carry (a record may hold one byte or none, and TLS 1.3 pads): an outside tester's
            # proxy of 1-byte records had 128 KiB on the socket for 5.6 KB of body, and a turn
            # was held 3.3 s in a read. Only what the TLS library has decrypted already counts.
            return self.tls.pending()
        return waiting_count(self.fd)

    def give_up(self) -> None:
        """Let another body parse (kept by nobody until :meth:`take`)."""
        if self.held:
            self.held = False
            self.sem.release()

    end = give_up


__all__ = ["MIN_READ", "PYTHON_TURNS", "Turn", "Turns", "default_slots"]
