"""A TCP relay that behaves like a real network link: a bandwidth cap per connection, an optional
cap on all connections together, and a delay per round trip.

Why: on loopback a connection has no bandwidth limit of its own, so every read-path figure
measured there says nothing about what bounds a load on a real link (object stores and CDNs cap
each connection; a host's link is reached only with many connections in parallel). Put this in
front of the Hub emulator or SeaweedFS and point a client at :attr:`ShapedLink.url`: every byte
of every connection then goes through the caps and the delay.

The shape (both directions of every connection):

- ``per_conn_bps``: bytes per second one connection carries at most (paced in slices of about
  10 ms, so a burst is never larger than that);
- ``total_bps``: bytes per second all connections together carry at most (None: no total cap);
- ``rtt_s``: a round trip's delay: every slice is delivered ``rtt_s / 2`` after it was paced, in
  each direction, and a new connection's first bytes wait one more ``rtt_s`` (TCP's handshake).

It listens on 127.0.0.1 by default: kvbucket's read path does not depend on whether the peer is
this machine (no loopback branch: see stores/hub/xet/reads.py), so a client behind the relay runs
the production path. Bounded: at most ``max_conns`` connections at once (more are refused), and
the relay stops by itself after ``lifetime_s``, whatever its users do.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any


@dataclass
class _Pace:
    """When the next slice may start on one cap (a connection's, or the total)."""

    bps: float
    next: float = 0.0

    def reserve(self, now: float, n: int) -> float:
        start = max(now, self.next)
        self.next = start + n / self.bps
        return start


@dataclass
class LinkStats:
    connections: int = 0
    refused: int = 0
    bytes_down: int = 0  # target -> client
    bytes_up: int = 0  # client -> target
    conn_bytes_down: list[int] = field(default_factory=list)


class ShapedLink:
    """A relay ``host:port`` -> ``target_host:target_port`` with the shape described above."""

    def __init__(self, target_port: int, *, per_conn_bps: float, total_bps: float | None = None,
                 rtt_s: float = 0.0, target_host: str = "127.0.0.1", host: str = "127.0.0.1",
                 max_conns: int = 512, lifetime_s: float = 1800.0) -> None:
        if per_conn_bps <= 0 or (total_bps is not None and total_bps <= 0) or rtt_s < 0:
            raise ValueError("caps must be positive and the round trip not negative")
        self.target = (target_host, target_port)
        self.host = host
        self.per_conn_bps = float(per_conn_bps)
        self.total_bps = None if total_bps is None else float(total_bps)
        self.rtt_s = float(rtt_s)
        self.max_conns = max_conns
        self.lifetime_s = lifetime_s
        self.stats = LinkStats()
        # a slice is ~10 ms of one connection's cap: small enough to pace, large enough for Python
        self._slice = int(min(256 << 10, max(16 << 10, self.per_conn_bps / 100)))
        self._total = {d: _Pace(self.total_bps) for d in ("up", "down")} if self.total_bps else None
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def floor_secs(self, nbytes: int, round_trips: int) -> float:
        """The link's floor for a load of ``nbytes`` in ``round_trips`` sequential round trips:
        bytes / total cap + round trips x RTT (without a total cap, the bytes cost nothing)."""
        return (nbytes / self.total_bps if self.total_bps else 0.0) + round_trips * self.rtt_s

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> ShapedLink:
        self._thread = threading.Thread(target=self._main, name="kvbucket-shaped-link", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError("the shaped link did not start")
        return self

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ShapedLink:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self._server = await asyncio.start_server(self._client, self.host, 0, backlog=1024)
            self.port = int(self._server.sockets[0].getsockname()[1])
        finally:
            self._ready.set()
        async with self._server:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.lifetime_s)  # stops by itself
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

    # ---- one connection -------------------------------------------------------------------
    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        """One connection; cancelled when the link closes, which ends it quietly (asyncio's
        stream callback logs a cancelled client task as an error with a traceback)."""
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay(cr, cw)

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self._open >= self.max_conns:
            self.stats.refused += 1
            cw.close()
            return
        self._open += 1
        self.stats.connections += 1
        k = len(self.stats.conn_bytes_down)
        self.stats.conn_bytes_down.append(0)
        try:
            if self.rtt_s:
                await asyncio.sleep(self.rtt_s)  # the handshake's round trip
            try:
                tr, tw = await asyncio.open_connection(*self.target)
            except OSError:
                return
            up = asyncio.ensure_future(self._pump(cr, tw, "up", None))
            down = asyncio.ensure_future(self._pump(tr, cw, "down", k))
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
            # one side closed: let the other finish what it was sending, then close both
            await asyncio.wait([up, down], timeout=max(1.0, 2 * self.rtt_s))
            for t in (up, down):
                t.cancel()
            for w in (tw, cw):
                w.close()
        finally:
            self._open -= 1
            with contextlib.suppress(Exception):
                cw.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, direction: str,
                    k: int | None) -> None:
        """Read, pace on the connection's cap and the total one, deliver half a round trip later.

        Stops reading as soon as delivery ended (the peer hung up, a write failed): bytes nobody
        will receive are neither read from the source nor charged to the caps, and the stats
        count only bytes handed to the peer (:meth:`_deliver`)."""
        pace = _Pace(self.per_conn_bps)
        total = self._total[direction] if self._total else None
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)
        writer = asyncio.ensure_future(self._deliver(queue, w, direction, k))
        loop = asyncio.get_running_loop()
        try:
            while not writer.done():
                data = await _unless(r.read(self._slice), writer)
                if not data:  # the source closed, or delivery ended meanwhile
                    break
                now = loop.time()
                start = pace.reserve(now, len(data))
                if total is not None:
                    start = max(start, total.reserve(now, len(data)))
                    pace.next = max(pace.next, start + len(data) / self.per_conn_bps)
                if start > now:
                    await _unless(asyncio.sleep(start - now), writer)
                await _unless(queue.put((loop.time() + self.rtt_s / 2, data)), writer)
        finally:
            if not writer.done():
                await _unless(queue.put((0.0, b"")), writer)
            with contextlib.suppress(Exception):
                await writer

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes]], w: asyncio.StreamWriter,
                       direction: str, k: int | None) -> None:
        """Write what the pump paced, when due; count each slice once the peer took it. Returns
        (or raises) when the pump is done or the peer is gone: the pump then stops reading."""
        loop = asyncio.get_running_loop()
        while True:
            at, data = await queue.get()
            if not data:
                with contextlib.suppress(Exception):
                    if w.can_write_eof():
                        w.write_eof()
                return
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if w.is_closing():  # the peer is gone (reset, closed): nothing more is delivered
                return
            # counted as handed over (before the write, so a peer that got the bytes never sees
            # a count short of them); at most the slice in flight when the peer left is counted
            if direction == "down":
                self.stats.bytes_down += len(data)
                if k is not None:
                    self.stats.conn_bytes_down[k] += len(data)
            else:
                self.stats.bytes_up += len(data)
            w.write(data)
            await w.drain()  # raises once the peer is gone: the pump then stops reading


async def _unless(aw: Any, stop: asyncio.Future[Any]) -> Any:
    """``aw``'s result, or None once ``stop`` is done first (``aw`` is then cancelled)."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


__all__ = ["LinkStats", "ShapedLink"]
