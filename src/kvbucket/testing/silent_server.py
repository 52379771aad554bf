"""A loopback server that accepts connections and never answers: the hung store of reliability tests.

A store that refuses connections fails fast; one that accepts and then says nothing is what
stalls a client for its full timeouts (a wedged load balancer, a stopped process whose socket is
still open, a black-holed network). Use :attr:`SilentServer.url` as the Hub endpoint or the S3
endpoint URL. Requests are read and dropped; connections stay open until :meth:`close`.

``SilentServer(trickle_secs=s)`` answers every request instead, with a valid HTTP response sent
one byte every ``s`` seconds: each read of the client returns within ``s``, so per-read timeouts
(httpx's, libcurl's low-speed limits aside) never trip, and only a bound on a request's total
time stops the client.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SilentServer:
    """``with SilentServer() as s: open_store(..., endpoint=s.url)``: every request hangs."""

    #: What a trickling server sends (slowly): a complete answer, an empty JSON list.
    TRICKLE_RESPONSE = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        b"X-Padding: a slow server, one byte at a time\r\n\r\n[]"
    )

    def __init__(self, trickle_secs: float | None = None) -> None:
        self.trickle_secs = trickle_secs
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(1024)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, name="kvbucket-silent-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
                self.accepted += 1
            if self.trickle_secs is not None:
                threading.Thread(target=self._trickle, args=(conn,), name="kvbucket-silent-trickle",
                                 daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        """Read a request's head, then send the answer one byte at a time (again per request)."""
        assert self.trickle_secs is not None
        try:
            while not self._closed:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        return
                    head += data
                for i in range(len(self.TRICKLE_RESPONSE)):
                    if self._closed:
                        return
                    conn.sendall(self.TRICKLE_RESPONSE[i : i + 1])
                    time.sleep(self.trickle_secs)
        except OSError:
            return  # the client gave up, or close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in conns:
            c.close()
        self._thread.join(5)

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SilentServer"]
