"""Benchmark helper: a read-only S3 stand-in that costs the box almost nothing per byte.

    python benchmarks/sendfile_s3.py ROOT      # prints "PORT <n>" once it listens on 127.0.0.1

Why (issue 30): on a 2-core machine SeaweedFS takes about one core to serve a load, so a client
whose ``get_many`` is split over threads cannot show more than the core that is left. This server
answers path-style ``HEAD`` and ``GET /<bucket>/<key>`` (the query string, presigned or not, and
the signature are ignored) with ``200``, ``Content-Length``, ``ETag``, ``Last-Modified`` and the
file ``ROOT/<bucket>/<key>`` sent by ``os.sendfile`` (the kernel copies it; no Python per byte),
keep-alive, one thread per connection. bench_ceiling copies the objects SeaweedFS holds into ROOT
(on /dev/shm), so its ``kvbucket-s3@sendfile`` side loads the same sealed objects as
``kvbucket-s3``, and its server's CPU is measured the same way.
Not an S3 server: no writes, no listing, no auth; a missing key is ``404`` with an empty body.
"""

from __future__ import annotations

import os
import sys
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: libcurl reuses its connections
    root = "."

    def _file(self) -> tuple[int, int] | None:
        """(fd, size) of the object the path names, or None (answered 404)."""
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        full = os.path.realpath(os.path.join(self.root, rel))
        if not full.startswith(self.root + os.sep) or not os.path.isfile(full):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        fd = os.open(full, os.O_RDONLY)
        st = os.fstat(fd)
        size = st.st_size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", f'"{st.st_ino:x}-{st.st_mtime_ns:x}"')  # S3 clients (object_store) want both
        self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
        self.end_headers()
        return fd, size

    def do_HEAD(self) -> None:
        got = self._file()
        if got is not None:
            os.close(got[0])

    def do_GET(self) -> None:
        got = self._file()
        if got is None:
            return
        fd, size = got
        try:
            sent, sock = 0, self.connection.fileno()
            while sent < size:
                n = os.sendfile(sock, fd, sent, size - sent)
                if n == 0:
                    break
                sent += n
        finally:
            os.close(fd)

    def log_message(self, format: str, *args: object) -> None:
        pass


class Server(ThreadingHTTPServer):
    request_queue_size = 1024  # clients open dozens of connections at once (socketserver's default: 5)
    daemon_threads = True


def main() -> int:
    Handler.root = os.path.realpath(sys.argv[1])
    server = Server(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
