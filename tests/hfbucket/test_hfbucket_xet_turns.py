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
from kvbucket.stores.hub.xet.turns import Turns


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


def test_over_tls_only_decrypted_bytes_count_as_here(tmp_path: Any) -> None:
    """Over TLS the socket's count is of records, which say nothing of the body bytes they hold:
    a server (or a TLS proxy in front of a slow one) sending 1-byte records put 128 KiB on the
    socket for 5.6 KB of body, and a turn was held 3.3 s in a read (an outside tester's case).
    Here 4 KiB go out as 1-byte records (~90 KiB on the wire), then nothing for a while: the read
    gives its turn up, the one turn is free for another body meanwhile, and the bytes are right."""
    import ssl

    from kvbucket.testing.tls import make_test_certificates

    certs = make_test_certificates(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.cert, certs.key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca))
    raw_server, raw_client = tcp_pair()
    raw_server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    done = threading.Event()
    body = bytes(range(256)) * 64  # 16 KiB

    def serve() -> None:
        with server_ctx.wrap_socket(raw_server, server_side=True) as tls:
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(4096):
                tls.sendall(body[i : i + 1])  # one record per byte
            done.wait(10)  # the rest only once the test has seen the turn free
            tls.sendall(body[4096:])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = client_ctx.wrap_socket(raw_client, server_hostname="127.0.0.1")
    try:
        resp = http.client.HTTPResponse(client)
        resp.begin()
        from kvbucket.stores.sockets import waiting_count

        end = time.monotonic() + 5
        while waiting_count(client.fileno()) < 60_000 and time.monotonic() < end:
            time.sleep(0.01)
        assert waiting_count(client.fileno()) >= 60_000  # records: far more on the wire than body
        turns = Turns(1)
        turn = turns.turn(time.monotonic() + 10, resp, client, compiled=False)
        turn.take()
        assert turn._here() <= 16 * 1024  # what TLS decrypted already, not the socket's count
        buf = bytearray(len(body))
        got: list[int] = []

        def read() -> None:
            n = 0
            while n < len(buf):
                n += turn.read_into(memoryview(buf)[n:], len(buf) - n)
            got.append(n)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        other = turns.turn(time.monotonic() + 10, resp, None, compiled=False)
        t0 = time.monotonic()
        other.take()  # free while the reader waits for the rest of the body
        waited = time.monotonic() - t0
        other.end()
        done.set()
        reader.join(10)
        assert waited < 2 and got == [len(body)] and bytes(buf) == body and turn.held
        turn.end()
    finally:
        done.set()
        client.close()
        server.join(5)


def test_the_default_is_one_turn_per_core_at_least_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xet_turns.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert xet_turns.default_slots() == 4
    monkeypatch.setattr(xet_turns.os, "sched_getaffinity", lambda pid: set(range(48)))
    assert xet_turns.default_slots() == 48
    turns = Turns(48)  # the Python decoder parses under the GIL: at most four at once there
    assert turns._python.free() == 4 and turns._compiled.free() == 48


_FORK_WHILE_HELD = r"""
import json, os, sys, time
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
spec = json.loads(open(sys.argv[1]).read())
cfg = build_config(bucket_handle=spec["handle"], token_env="KVB_TEST_TOKEN", endpoint=spec["endpoint"],
                   read_slots=2, load_timeout_secs=8.0)
store = HFBucketStore(cfg)
names = spec["names"]
assert all(r.ok for r in store.get_many(names))  # connections kept in the reader's pool
reader = store._client._reader
assert reader._conns._idle and any(q.qsize() for q in reader._conns._idle.values())
held = 0
for sem in (reader._turns._python, reader._turns._compiled, reader._budget):
    while sem.acquire(timeout=0):  # as threads of a load in flight hold them at the fork
        held += 1
pid = os.fork()
if pid == 0:
    fresh = not any(q.qsize() for q in reader._conns._idle.values())
    t = time.monotonic()
    got = store.get_many(names)
    ok = all(r.ok for r in got) and [bytes(r.data) for r in got] == [bytes.fromhex(h) for h in spec["data"]]
    os._exit(0 if ok and fresh and time.monotonic() - t < 4 else 3)
t = time.monotonic()
while time.monotonic() - t < 60:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(4)
"""


def test_a_child_forked_while_turns_are_held_loads_with_its_own(hub_bucket: Any, tmp_path: Any) -> None:
    """A process forking beside a load (a server starting its workers): the child inherits the
    reader's turns and ranged-GET budget as the parent's threads held them, but not those
    threads, so they were never released there and every load of the child waited for a turn
    until its deadline. The child now starts with all of them, and with none of the parent's
    kept connections (two processes reading one socket read each other's answers)."""
    import json
    import os
    import subprocess
    import sys

    from kvbucket.stores.hub.config import build_config
    from kvbucket.stores.hub.store import HFBucketStore

    names = [f"fork{i}" for i in range(4)]
    data = [os.urandom(300_000 + i) for i in range(4)]
    handle = f"hf://buckets/{hub_bucket.bucket_id}/forked"
    cfg = build_config(bucket_handle=handle, token=hub_bucket.hub.write_token, token_env="",
                       endpoint=hub_bucket.hub.endpoint)
    with HFBucketStore(cfg) as writer:
        assert all(r.ok for r in writer.put_many(list(zip(names, data, strict=True))))
    spec = {"handle": handle, "endpoint": hub_bucket.hub.endpoint, "names": names,
            "data": [d.hex() for d in data]}
    env = {**os.environ, "KVB_TEST_TOKEN": hub_bucket.hub.write_token}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-c", _FORK_WHILE_HELD, str(tmp_path / "spec.json")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
