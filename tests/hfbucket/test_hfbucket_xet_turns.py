"""Parse turns (stores/hub/xet/turns.py): a turn is held only while a body's bytes are already
here, never across a wait for the network. Real sockets and ``http.client`` responses, the
decoder's own body reader (``decode._Body``)."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvbucket.stores.hub.xet import decode as xet_decode
from kvbucket.stores.hub.xet import turns as xet_turns
from kvbucket.stores.hub.xet.turns import Turn, Turns


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a TCP connection on loopback: (server side, client side)."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        client = socket.create_connection(lsock.getsockname())
        server, _ = lsock.accept()
    return server, client


class Answer:
    """An HTTP answer of ``size`` body bytes on a socket pair: ``send(n)`` puts n more on the wire."""

    def __init__(self, size: int, chunked: bool = False) -> None:
        self.server, self.client = tcp_pair()
        self.body, self.sent = bytes((i * 7 + 3) % 251 for i in range(size)), 0
        self.sending: threading.Thread | None = None
        head = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
        self.chunked = chunked
        self.server.sendall(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n")
        self.resp = http.client.HTTPResponse(self.client)
        self.resp.begin()

    def send(self, n: int) -> None:
        """Send n more body bytes (from a thread: the socket holds only so much unread)."""
        part = self.body[self.sent : self.sent + n]
        self.sent += len(part)
        wire = b"%x\r\n%s\r\n" % (len(part), part) if self.chunked else part
        if self.chunked and self.sent == len(self.body):
            wire += b"0\r\n\r\n"
        before = self.sending
        self.sending = threading.Thread(target=lambda: (before and before.join(), self.server.sendall(wire)),
                                        daemon=True)
        self.sending.start()

    def on_the_wire(self, n: int) -> None:
        """Wait until ``n`` bytes wait unread at the client."""
        from kvbucket.stores.sockets import waiting_count

        end = time.monotonic() + 5
        while waiting_count(self.client.fileno()) < n and time.monotonic() < end:
            time.sleep(0.005)

    def close(self) -> None:
        self.resp.close()
        self.server.close()
        self.client.close()


@pytest.fixture
def answers() -> Iterator[list[Answer]]:
    made: list[Answer] = []
    yield made
    for a in made:
        a.close()


def counting(n: int) -> tuple[Turns, dict[str, int]]:
    """Turns whose semaphores count acquisitions and releases."""
    turns, counts = Turns(n), {"acquire": 0, "release": 0}

    class Counted:
        def __init__(self, sem: threading.Semaphore) -> None:
            self.sem = sem

        def acquire(self, timeout: float | None = None) -> bool:
            counts["acquire"] += 1
            return self.sem.acquire(timeout=timeout)

        def release(self) -> None:
            counts["release"] += 1
            self.sem.release()

    turns._compiled = Counted(turns._compiled)  # type: ignore[assignment]
    turns._python = Counted(turns._python)  # type: ignore[assignment]
    return turns, counts


def test_bytes_already_here_are_read_without_giving_the_turn_up(answers: list[Answer]) -> None:
    a = Answer(100_000)
    answers.append(a)
    a.send(100_000)
    a.on_the_wire(100_000)
    turns, counts = counting(1)
    turn = turns.turn(time.monotonic() + 5, a.resp, a.client, compiled=False)
    turn.take()
    buf = bytearray(100_000)
    got = 0
    while got < len(buf):
        got += turn.read_into(memoryview(buf)[got:], 1)
    assert bytes(buf) == a.body and turn.held
    assert counts == {"acquire": 1, "release": 0}  # never given up: every read found its bytes here
    turn.end()
    assert counts["release"] == 1 and not turn.held


@pytest.mark.parametrize("chunked", [False, True])
def test_a_read_that_waits_for_the_network_holds_no_turn(answers: list[Answer], chunked: bool) -> None:
    """The invariant turns.py states, checked where it is kept: while a body's read waits for
    bytes, its turn is free for another body (one turn here), and it is held again on return."""
    a = Answer(300_000, chunked=chunked)
    answers.append(a)
    turns = Turns(1)
    turn = turns.turn(time.monotonic() + 5, a.resp, a.client, compiled=True)
    turn.take()
    got: list[int] = []
    buf = bytearray(300_000)
    reader = threading.Thread(target=lambda: got.append(turn.read_into(memoryview(buf), 100_000)),
                              daemon=True)
    reader.start()
    time.sleep(0.1)  # the reader is waiting: nothing sent yet
    other = turns.turn(time.monotonic() + 5, a.resp, None, compiled=True)
    t0 = time.monotonic()
    other.take()  # the one turn: free while the reader waits
    assert time.monotonic() - t0 < 1 and reader.is_alive()
    other.end()
    a.send(300_000)
    reader.join(5)
    assert not reader.is_alive() and got and got[0] > 0 and turn.held
    assert bytes(buf[: got[0]]) == a.body[: got[0]]
    turn.end()


def test_a_trickling_body_does_not_hold_up_the_others(answers: list[Answer]) -> None:
    """Two bodies, one turn: the first trickles (a few KiB, then nothing for a while), the second
    is all here. The second is parsed whole through the decoder's body reader while the first
    waits, where a turn held for a whole body would keep it out until the first ended."""
    slow, fast = Answer(400_000), Answer(100_000)
    answers += [slow, fast]
    turns = Turns(1)
    deadline = time.monotonic() + 10
    done: dict[str, float] = {}

    def parse(name: str, ans: Answer) -> None:
        turn = turns.turn(deadline, ans.resp, ans.client, compiled=False)
        turn.take()
        try:
            body = xet_decode._Body(ans.resp, xet_decode.Window(), len(ans.body), turn)
            body.ensure(len(ans.body))  # (a chunk larger than the window: the window grows)
            assert bytes(body.w.mv[body.start : body.end]) == ans.body
        finally:
            turn.end()
        done[name] = time.monotonic()

    slow.send(4096)
    t_slow = threading.Thread(target=parse, args=("slow", slow), daemon=True)
    t_slow.start()
    time.sleep(0.1)  # the slow body holds its turn first, then waits for the rest
    fast.send(100_000)
    fast.on_the_wire(100_000)
    t_fast = threading.Thread(target=parse, args=("fast", fast), daemon=True)
    t_fast.start()
    t_fast.join(5)
    assert "fast" in done and "slow" not in done
    slow.send(400_000)
    t_slow.join(5)
    assert "slow" in done


def test_tls_counts_down_what_its_records_may_hide() -> None:
    """Over TLS the socket's count is of records: a partial record and each record's overhead
    are not body bytes, so a count of one record or less is "nothing here"."""

    class Tls:
        def __init__(self, pending: int) -> None:
            self.p = pending

        def pending(self) -> int:
            return self.p

    a, b = tcp_pair()
    try:
        turn = Turn(threading.Semaphore(1), time.monotonic() + 5, _head_only(), a)
        b.sendall(b"x" * 20_000)
        time.sleep(0.05)
        assert turn._here() == 20_000
        turn.tls = Tls(0)  # type: ignore[assignment]
        assert turn._here() <= 20_000 - 16 * 1024 - 20_000 // 565
        turn.tls = Tls(5_000)  # type: ignore[assignment]
        assert 5_000 <= turn._here() <= 5_000 + 20_000 - 16 * 1024 - 20_000 // 565  # decrypted: here
    finally:
        a.close()
        b.close()


def _head_only() -> Any:
    class Resp:
        chunked = False

    return Resp()


def test_the_default_is_one_turn_per_core_at_least_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xet_turns.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert xet_turns.default_slots() == 4
    monkeypatch.setattr(xet_turns.os, "sched_getaffinity", lambda pid: set(range(48)))
    assert xet_turns.default_slots() == 48
    turns = Turns(48)  # the Python decoder parses under the GIL: at most four at once there
    assert turns._python._value == 4 and turns._compiled._value == 48  # type: ignore[attr-defined]
