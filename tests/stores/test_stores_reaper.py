"""The socket reaper's word on a request decides whether its connection may be kept.

A request that read ``fired`` as False and then released its watch could, before this rule, put
its connection back while the reaper had already picked the socket: the next request on it was
then cut at the first request's deadline. The rule: the connection is kept only when
``release`` says the reaper did not take the watch first.
"""

from __future__ import annotations

import socket
import time

from kvbucket.stores.deadline import SocketReaper


def _wait(cond, secs: float = 5.0) -> bool:
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_watch_the_reaper_took_is_reported_at_release_and_its_socket_is_shut() -> None:
    reaper = SocketReaper()
    a, b = socket.socketpair()
    with a, b:
        w = reaper.watch(time.monotonic() + 0.05)
        reaper.attach(w, a)
        looked = w.fired  # the race: the request looks (not fired yet), then the reaper picks it
        assert _wait(lambda: w.fired)
        assert looked is False and reaper.release(w) is True  # the answer at release counts
        a.settimeout(5)
        assert a.recv(1) == b""  # shut: the end of the stream at once, nothing was sent


def test_a_watch_released_before_its_deadline_is_never_shut_after() -> None:
    reaper = SocketReaper()
    a, b = socket.socketpair()
    with a, b:
        w = reaper.watch(time.monotonic() + 0.1)
        reaper.attach(w, a)
        assert reaper.release(w) is False  # the connection may be kept
        time.sleep(0.3)  # past the deadline: the reaper has run and skipped it
        assert not w.fired
        b.sendall(b"still open")
        assert a.recv(64) == b"still open"
        a.sendall(b"both ways")
        assert b.recv(64) == b"both ways"

