"""Keep-alive HTTP(S) connections of the Xet reader, per host, reused between loads."""

from __future__ import annotations

import http.client
import os
import queue
import ssl
import threading
import weakref

from kvbucket.stores.deadline import REAPER, Watch


class Connections:
    """Keep-alive HTTP(S) connections per host, reused between batches (no handshake per load)."""

    def __init__(self, size: int) -> None:
        self._idle: dict[tuple[str, str], queue.LifoQueue[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._size = size
        self._tls: ssl.SSLContext | None = None
        _pools.add(self)

    def _forget(self) -> None:
        """In a forked child: the idle connections are the parent's sockets too (two processes
        reading one socket read each other's answers). The child closes its copies of them, which
        leaves the parent's open (no shutdown), and makes its own."""
        idle, self._idle, self._lock = self._idle, {}, threading.Lock()
        for q in idle.values():
            while not q.empty():
                sock = q.get_nowait().sock
                if sock is not None:
                    sock.close()

    def tls(self) -> ssl.SSLContext:
        """One TLS context for every connection: ``http.client`` makes a new one per connection
        by default, which loads the system's CA certificates each time (tens of milliseconds of
        CPU, times a batch's new connections in a fresh process)."""
        with self._lock:
            if self._tls is None:
                self._tls = ssl.create_default_context()  # what http.client would use, made once
            return self._tls

    def _queue(self, scheme: str, netloc: str) -> queue.LifoQueue[http.client.HTTPConnection]:
        """The idle connections to one host (made once: a queue is three conditions and a lock,
        which ``setdefault`` built and dropped twice per fetch)."""
        q = self._idle.get((scheme, netloc))
        if q is None:
            with self._lock:
                q = self._idle.setdefault((scheme, netloc), queue.LifoQueue())
        return q

    def get(self, scheme: str, netloc: str, timeout: float, fresh: bool = False
            ) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it is a reused one (which the server may have closed)."""
        q = self._queue(scheme, netloc)
        if not fresh:
            try:
                conn = q.get_nowait()
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                return conn, True
            except queue.Empty:
                pass
        if scheme == "https":
            return http.client.HTTPSConnection(netloc, timeout=timeout, context=self.tls()), False
        return http.client.HTTPConnection(netloc, timeout=timeout), False

    def send(self, scheme: str, netloc: str, timeout: float, target: str, headers: dict[str, str],
             watch: Watch) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a GET and read its status line; a kept-alive connection the server closed
        meanwhile (its idle timeout) is replaced once, transparently. From the moment it is
        sent, the request's socket is ``watch``ed: shut down at the request's deadline."""
        conn, reused = self.get(scheme, netloc, timeout)
        try:
            conn.request("GET", target, headers=headers)
            REAPER.attach(watch, conn.sock)
            return conn, conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if not reused or watch.fired:  # shut at the deadline: not a server's idle timeout
                raise
        conn, _ = self.get(scheme, netloc, timeout, fresh=True)
        try:
            conn.request("GET", target, headers=headers)
            REAPER.attach(watch, conn.sock)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def put(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        q = self._queue(scheme, netloc)
        if q.qsize() < self._size:
            q.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        with self._lock:
            queues, self._idle = list(self._idle.values()), {}
        for q in queues:
            while not q.empty():
                q.get_nowait().close()


_pools: weakref.WeakSet[Connections] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [p._forget() for p in list(_pools)])

__all__ = ["Connections"]
