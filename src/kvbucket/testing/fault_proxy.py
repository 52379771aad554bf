"""A loopback HTTP relay that fails requests on purpose (throttling, 5xx, cuts, hang-ups, trickles).

Put it in front of any local HTTP server (the S3 fixtures use it in front of SeaweedFS; the
fault tests of the Hub client in front of the emulator). It also acts as an HTTP proxy, so
virtual-hosted S3 names such as ``<bucket>.s3.kvbucket.test`` reach a local server without DNS.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
}


@dataclass
class Fault:
    """``times`` answers of ``status`` with S3 error ``code``.

    Special statuses: 0 drops the connection unanswered; ``CUT`` forwards the request but sends
    only the first half of the body (with the full Content-Length) and hangs up; ``HANG_UP``
    forwards it whole and then closes the connection without saying so, as a server does with
    an idle keep-alive connection; ``TRICKLE`` forwards it and sends the answer's headers at
    once, then its body one byte every ``delay`` seconds (a slow transfer, not a hung server);
    ``FLIP`` forwards it and flips one bit in the middle of the answer's body (damage on the
    wire: what the server stores stays intact); ``NEW_VERSION`` answers a ranged GET from
    "another version" of the object, of the same size (every body byte inverted, another ETag: a
    writer replaced it between two ranges); ``IGNORE_RANGE`` forwards a GET without its Range
    header (the whole object, 200, as a server or proxy ignoring Range does), its body sent in
    64 KiB pieces ``delay`` seconds apart (a slow link); ``NO_ETAG`` forwards it and drops the
    answer's ETag header (some S3-compatible servers, or a proxy stripping it). ``ranged``: only
    GETs with a Range header match; ``skip``: that many matching requests pass unharmed first.
    """

    status: int
    code: str
    times: int
    methods: frozenset[str] | None = None
    delay: float = 0.0
    path_contains: str | None = None
    ranged: bool = False
    skip: int = 0


CUT = -1
HANG_UP = -2
TRICKLE = -3
FLIP = -4
NEW_VERSION = -5
IGNORE_RANGE = -6
NO_ETAG = -7
_PIECE = 64 * 1024
_INVERT = bytes(255 - i for i in range(256))  # another version: every byte inverted


class FaultProxy:
    """A loopback HTTP relay to ``127.0.0.1:target_port`` that can fail requests on purpose.

    ``latency`` adds that many seconds to every request (as a distant region would), ``log``
    records when each request arrived and was answered (and ``order`` on which connection, in
    which order of events), and :meth:`round_trips` counts the sequential round trips a client
    made, from causal order.

    It accepts origin-form requests (use its URL as the S3 endpoint) and absolute-form requests
    (use it as the client's HTTP proxy: then any host name, e.g. ``b.s3.kvbucket.test:PORT``, is
    sent to the target with its Host header intact, which makes virtual-hosted addressing testable
    without DNS). Requests are forwarded unchanged, so signatures still verify upstream.
    """

    def __init__(self, target_port: int, tls: tuple[str, str] | None = None) -> None:
        """``tls``: (certificate PEM file, key PEM file) to serve HTTPS instead of HTTP."""
        self.target_port = target_port
        self.tls = tls
        self.faults: list[Fault] = []
        self.requests = 0
        self.injected = 0
        self.hosts: list[str] = []
        self.targets: list[tuple[str, str]] = []  # (method, request target) of every request
        #: (method, request target) of every request that had an answer (status line sent). A
        #: request whose upstream failed has none: the client (libcurl) may send it again on a
        #: fresh connection, so counting ``targets`` would count that request twice.
        self.answered: list[tuple[str, str]] = []
        #: Body bytes of answers written to clients (a cut connection's unsent rest not counted).
        self.body_bytes = 0
        #: Requests being handled now, and the most there were at once.
        self.in_flight = 0
        self.peak_in_flight = 0
        #: Seconds added to every request before it is forwarded (a wide-area round trip).
        self.latency = 0.0
        #: (method, request target, arrived, answered) of every request, monotonic seconds.
        self.log: list[tuple[str, str, float, float]] = []
        #: (connection, arrival, answer) of every request, as ``log``: places in one order of events.
        self.order: list[tuple[int, int, int]] = []
        self._seq = itertools.count()
        self._conn_ids = itertools.count()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def fail(
        self,
        status: int,
        code: str = "SlowDown",
        times: int = 1,
        methods: set[str] | None = None,
        delay: float = 0.0,
        path_contains: str | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with ``status``/``code`` (after ``delay``)."""
        with self._lock:
            self.faults.append(
                Fault(status, code, times, frozenset(methods) if methods else None, delay, path_contains)
            )

    def drop(self, times: int = 1, methods: set[str] | None = None) -> None:
        self.fail(0, "", times, methods)

    def cut(self, times: int = 1, methods: set[str] | None = None) -> None:
        """Send only half of the next ``times`` bodies, then hang up."""
        self.fail(CUT, "", times, methods)

    def hang_up_after(self, times: int = 1, methods: set[str] | None = None) -> None:
        """Answer the next ``times`` requests in full, then close their connections silently."""
        self.fail(HANG_UP, "", times, methods)

    def trickle(self, per_byte_secs: float, times: int = 1, methods: set[str] | None = None,
                path_contains: str | None = None) -> None:
        """Send the next ``times`` bodies one byte every ``per_byte_secs`` (headers at once)."""
        with self._lock:
            self.faults.append(Fault(TRICKLE, "", times, frozenset(methods) if methods else None,
                                     per_byte_secs, path_contains))

    def new_version(self, times: int = 1, skip: int = 0) -> None:
        """Answer ``times`` ranged GETs, after ``skip`` more, from another version of the object."""
        with self._lock:
            self.faults.append(Fault(NEW_VERSION, "", times, frozenset({"GET"}), ranged=True, skip=skip))

    def ignore_range(self, times: int = 1, per_piece_secs: float = 0.0) -> None:
        """Forward the next ``times`` GETs without their Range header (a 200 with every byte)."""
        with self._lock:
            self.faults.append(Fault(IGNORE_RANGE, "", times, frozenset({"GET"}), per_piece_secs))

    def strip_etags(self, times: int = 1, ranged: bool = True) -> None:
        """Answer the next ``times`` GETs (``ranged``: only those with a Range header) without an ETag."""
        with self._lock:
            self.faults.append(Fault(NO_ETAG, "", times, frozenset({"GET"}), ranged=ranged))

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def round_trips(self, since: int = 0) -> int:
        """Sequential round trips of the requests logged from index ``since`` on: the longest
        chain of requests each provably sent after the previous one was answered, from causal
        order (hub_emulator.request_log): on an HTTP/1.1 connection a client sends a request only
        after it has read the previous answer. Not from time gaps: a request the proxy's threads
        noticed late on a loaded machine would start a second chain the client never made."""
        from kvbucket.testing.hub_emulator.request_log import causal_round_trips

        with self._lock:
            order = self.order[since:]
        return causal_round_trips([{"conn": str(c), "seq": [a, b]} for c, a, b in order])

    def _take(self, method: str, path: str, ranged: bool = False) -> Fault | None:
        with self._lock:
            self.requests += 1
            for f in self.faults:
                if (
                    f.times > 0
                    and (f.methods is None or method in f.methods)
                    and (f.path_contains is None or f.path_contains in path)
                    and (ranged or not f.ranged)
                ):
                    if f.skip > 0:
                        f.skip -= 1
                        return None
                    f.times -= 1
                    self.injected += 1
                    return f
            return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: an answer goes out as headers, then body (two sends); with Nagle's
            # algorithm the body waited for the client's delayed ACK of the headers, ~40 ms a request
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def setup(self) -> None:
                super().setup()
                self._conn = next(proxy._conn_ids)  # one handler per connection

            def _handle(self) -> None:
                self._arrived, self._logged = time.monotonic(), False
                self._seq_in = next(proxy._seq)
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.peak_in_flight = max(proxy.peak_in_flight, proxy.in_flight)
                try:
                    self._relay()
                finally:
                    self._record()
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _record(self) -> None:
                """Log the request once, before its answer leaves: a client that has its bytes
                must find the request in ``log`` (logging after the write raced the client)."""
                if not self._logged:
                    self._logged = True
                    with proxy._lock:
                        proxy.log.append((self.command, self.path, self._arrived, time.monotonic()))
                        proxy.order.append((self._conn, self._seq_in, next(proxy._seq)))

            def send_response(self, code: int, message: str | None = None) -> None:
                self._record()
                with proxy._lock:
                    proxy.answered.append((self.command, self.path))
                super().send_response(code, message)

            def _relay(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.hosts.append(self.headers.get("Host", ""))
                    proxy.targets.append((self.command, self.path))
                if proxy.latency:
                    time.sleep(proxy.latency)
                fault = proxy._take(self.command, self.path, "Range" in self.headers)
                if fault is not None and fault.status not in (CUT, HANG_UP, TRICKLE, FLIP, NEW_VERSION,
                                                              IGNORE_RANGE, NO_ETAG):
                    if fault.delay:
                        time.sleep(fault.delay)
                    if fault.status == 0:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                        f"<Message>injected by FaultProxy</Message></Error>"
                    ).encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    if fault.status in (429, 503):
                        self.send_header("Retry-After", "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                    return
                path = self.path
                if "://" in path:
                    parts = urlsplit(path)
                    path = parts.path + (f"?{parts.query}" if parts.query else "")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                if self.command in ("GET", "HEAD", "DELETE") and not body:
                    headers.pop("Content-Length")
                if fault is not None and fault.status == IGNORE_RANGE:
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                try:
                    conn.putrequest(self.command, path, skip_host=True, skip_accept_encoding=True)
                    for k, v in headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                length_sent = False
                other = fault is not None and fault.status == NEW_VERSION and resp.status == 206
                for k, v in resp.getheaders():
                    if k.lower() in _HOP_BY_HOP:
                        continue
                    if fault is not None and fault.status == NO_ETAG and k.lower() == "etag":
                        continue
                    if other and k.lower() == "etag":
                        v = '"0123456789abcdef0123456789abcdef"'  # another version's
                    if k.lower() == "content-length":
                        if self.command != "HEAD":
                            continue
                        length_sent = True
                    self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                elif not length_sent:
                    self.send_header("Content-Length", "0")
                self.end_headers()
                if fault is not None and fault.status == CUT:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.status == TRICKLE and self.command != "HEAD":
                    self.wfile.flush()
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(fault.delay)
                    return
                if fault is not None and fault.status == FLIP and data:
                    flipped = bytearray(data)
                    flipped[len(flipped) // 2] ^= 0x01
                    data = bytes(flipped)
                if other and data:
                    data = data.translate(_INVERT)
                if fault is not None and fault.status == IGNORE_RANGE and data:
                    for i in range(0, len(data), _PIECE):
                        self.wfile.write(data[i : i + _PIECE])
                        self.wfile.flush()
                        with proxy._lock:
                            proxy.body_bytes += len(data[i : i + _PIECE])
                        time.sleep(fault.delay)
                    return
                if self.command != "HEAD" and data:
                    self.wfile.write(data)
                    with proxy._lock:
                        proxy.body_bytes += len(data)
                if fault is not None and fault.status == HANG_UP:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients that timed out on purpose hang up mid-answer

        self._httpd = Server(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self.tls)
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)
        # serve_forever polls for shutdown() every poll_interval: 0.5 s by default, which each
        # test's teardown waited for (~0.5 s x every test on the fault_proxy fixture)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="kvbucket-fault-proxy",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["CUT", "FLIP", "HANG_UP", "IGNORE_RANGE", "NEW_VERSION", "NO_ETAG", "TRICKLE", "Fault",
           "FaultProxy"]
