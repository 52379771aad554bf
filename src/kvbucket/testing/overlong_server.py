"""A loopback S3 stand-in that sends more than it announces: the hostile neighbour of HTTP framing.

On HTTP/1.1 an answer ends where its Content-Length says; bytes after it on a kept-alive
connection are read by the next request as its answer. This server answers GETs and HEADs of a
fixed set of objects (any bucket, path-style, signatures not checked) and, for the keys in
``overlong``, sends one more whole answer carrying another key's bytes of the same size after the
body: in the same write (``pause=None``), or ``pause`` seconds later; it then sets :attr:`sent`
once the client's kernel has acknowledged them, so a test can send its next request only when
those bytes wait on the client's socket. ``requests``
records (connection number, method, key) of every request, so a test can tell a reused
connection from a new one. ``tls=(certificate, key)`` answers over TLS, where excess that shares
a TLS record with the body waits decrypted in the client's TLS library (docs/s3.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import ssl
import struct
import termios
import threading
import time
from urllib.parse import unquote, urlsplit

_MISSING = b"<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code></Error>"
_EMPTY_LIST = (b"<?xml version=\"1.0\"?><ListBucketResult><Name>b</Name><KeyCount>0</KeyCount>"
               b"<IsTruncated>false</IsTruncated></ListBucketResult>")


def answer(status: str, body: bytes, length: int | None = None, head: bool = False) -> bytes:
    """One HTTP/1.1 answer (kept alive); ``length`` overrides the announced Content-Length."""
    n = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\nContent-Length: {n}\r\nContent-Type: application/octet-stream\r\n"
            f"ETag: \"e\"\r\n\r\n").encode() + (b"" if head else body)


def _delivered(conn: socket.socket, within: float = 10.0) -> None:
    """Wait until the peer's kernel has acknowledged all that was sent (TIOCOUTQ: bytes not yet
    acknowledged), so those bytes are on the client's socket, not on their way."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            unacknowledged = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except (OSError, ValueError):  # closed meanwhile (by the client, or by close())
            return
        if unacknowledged == 0:
            return
        time.sleep(0.0005)


class OverlongServer:
    """``with OverlongServer(objects, overlong={"a"}) as s: ...`` then ``s.url`` as the S3 endpoint."""

    def __init__(self, objects: dict[str, bytes], overlong: set[str], *, pause: float | None = None,
                 head_body: bool = False, tls: tuple[str, str] | None = None) -> None:
        self.objects = objects
        self.overlong = overlong
        self.pause = pause
        self.head_body = head_body  # a HEAD answered with its body too (more than a HEAD announces)
        self._tls: ssl.SSLContext | None = None  # (certificate, key): answer over TLS
        if tls is not None:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(*tls)
        self.requests: list[tuple[int, str, str]] = []
        self.sent = threading.Event()  # set once an over-long answer's extra bytes are all sent
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="kvbucket-overlong-server", daemon=True).start()

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self._sock.getsockname()[1]}"

    def connections_of(self, method: str = "GET") -> list[int]:
        """The connection number of every request of ``method``, in order."""
        with self._lock:
            return [c for c, m, _ in self.requests if m == method]

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            number += 1
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _other(self, key: str) -> bytes:
        """Another object's bytes of the same size as ``key``'s (what the extra answer carries)."""
        size = len(self.objects[key])
        return next((v for k, v in sorted(self.objects.items()) if k != key and len(v) == size),
                    bytes(255 - b for b in self.objects[key]))

    def _serve(self, conn: socket.socket, number: int) -> None:
        pending = b""
        try:
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            while True:
                while b"\r\n\r\n" not in pending:
                    got = conn.recv(65536)
                    if not got:
                        return
                    pending += got
                head, pending = pending.split(b"\r\n\r\n", 1)
                method, target = head.split(b"\r\n", 1)[0].decode().split(" ")[:2]
                parts = urlsplit(target)
                key = unquote(parts.path.lstrip("/").partition("/")[2])
                with self._lock:
                    self.requests.append((number, method, key))
                self._answer(conn, method, key, "list-type" in parts.query)
        except OSError:
            return
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, method: str, key: str, listing: bool) -> None:
        head = method == "HEAD"
        if listing:
            conn.sendall(answer("200 OK", _EMPTY_LIST))
            return
        if key not in self.objects:
            conn.sendall(answer("404 Not Found", _MISSING, head=head))
            return
        body = self.objects[key]
        out = answer("200 OK", body, head=head and not self.head_body)
        if key not in self.overlong:
            conn.sendall(out)
            return
        extra = answer("200 OK", self._other(key))
        if self.pause is None:
            conn.sendall(out + extra)
        else:
            conn.sendall(out)
            time.sleep(self.pause)
            conn.sendall(extra)
        _delivered(conn)
        self.sent.set()

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def __enter__(self) -> OverlongServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
