"""The shaped link (kvbucket.testing.shaped_link): its caps and its delay hold, within tolerance."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from kvbucket.testing.shaped_link import ShapedLink


class _Source(socketserver.ThreadingTCPServer):
    """Answers every line ``N\\n`` with N bytes (a request and its response: one round trip)."""

    daemon_threads = True
    allow_reuse_address = True


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            n = int(line)
            self.wfile.write(b"x" * n)
            self.wfile.flush()


@pytest.fixture
def source() -> Iterator[int]:
    srv = _Source(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()


def _fetch(port: int, n: int, times: int = 1) -> float:
    """Seconds to connect and receive ``n`` bytes ``times`` times, one request after the other."""
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for _ in range(times):
            s.sendall(f"{n}\n".encode())
            got = 0
            while got < n:
                chunk = s.recv(1 << 20)
                assert chunk, "the relay closed early"
                got += len(chunk)
    return time.perf_counter() - t


def test_one_connection_is_capped(source: int) -> None:
    with ShapedLink(source, per_conn_bps=8e6) as link:
        secs = _fetch(link.port, 4_000_000)
    assert 0.45 <= secs <= 0.75, secs  # 4 MB at 8 MB/s: 0.5 s
    assert link.stats.bytes_down == 4_000_000


def test_connections_are_capped_each_and_together(source: int) -> None:
    def parallel(link: ShapedLink, k: int, n: int) -> float:
        t = time.perf_counter()
        threads = [threading.Thread(target=_fetch, args=(link.port, n)) for _ in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    with ShapedLink(source, per_conn_bps=8e6) as link:  # each capped, not together: 4 x 2 MB in 0.25 s
        secs = parallel(link, 4, 2_000_000)
    assert 0.22 <= secs <= 0.5, secs
    with ShapedLink(source, per_conn_bps=8e6, total_bps=8e6) as link:  # together 8 MB/s: 1 s
        secs = parallel(link, 4, 2_000_000)
    assert 0.95 <= secs <= 1.4, secs
    assert link.floor_secs(8_000_000, 0) == pytest.approx(1.0)


def test_round_trips_are_delayed(source: int) -> None:
    with ShapedLink(source, per_conn_bps=1e9, rtt_s=0.05) as link:
        secs = _fetch(link.port, 10, times=4)  # handshake + 4 requests: 5 round trips
    assert 0.24 <= secs <= 0.4, secs
    assert link.floor_secs(0, 5) == pytest.approx(0.25)


def test_bounded_and_stops_by_itself(source: int) -> None:
    link = ShapedLink(source, per_conn_bps=1e9, max_conns=1, lifetime_s=0.5).start()
    with socket.create_connection(("127.0.0.1", link.port), timeout=5) as first:
        first.sendall(b"3\n")
        assert first.recv(3) == b"xxx"
        with socket.create_connection(("127.0.0.1", link.port), timeout=5) as second:
            assert second.recv(1) == b""  # over the bound: refused (closed at once)
    assert link.stats.refused == 1
    assert link._thread is not None
    link._thread.join(5)
    assert not link._thread.is_alive()  # its lifetime ended: stopped without close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", link.port), timeout=1).close()


def test_closes_quietly_with_connections_open(source: int, caplog: pytest.LogCaptureFixture) -> None:
    """(issue 41's tester, case_drop_link) Closing the link while clients are connected printed
    one asyncio "Exception in callback ... CancelledError" traceback per open connection."""
    link = ShapedLink(source, per_conn_bps=1e9).start()
    conns = [socket.create_connection(("127.0.0.1", link.port), timeout=5) for _ in range(3)]
    try:
        for c in conns:
            c.sendall(b"3\n")
            assert c.recv(3) == b"xxx"
        link.close()
        assert link._thread is not None and not link._thread.is_alive()
    finally:
        for c in conns:
            c.close()
    said = [(r.getMessage(), r.exc_info) for r in caplog.records if r.name == "asyncio"]
    assert said == [], said  # asyncio's loop logs through logging (stderr outside pytest)


def test_bytes_nobody_received_are_not_counted(source: int) -> None:
    """(issue 41's second tester, c_shaped_count) A client that read 16 KiB of a 16 MiB answer and
    hung up: the relay kept reading from the target for up to a second more and counted those
    bytes as carried down (and charged them to the caps). It stops reading once delivery fails."""
    n = 16 << 20
    with ShapedLink(source, per_conn_bps=32e6) as link:
        with socket.create_connection(("127.0.0.1", link.port), timeout=5) as s:
            s.sendall(f"{n}\n".encode())
            got = 0
            while got < 16384:
                chunk = s.recv(16384 - got)
                assert chunk
                got += len(chunk)
        time.sleep(1.5)  # the relay's grace after one side closed is max(1 s, 2 x rtt)
        down = link.stats.bytes_down
    assert got <= down <= 2 << 20, down  # before: ~16 MiB (32 MB/s for the second of grace)
