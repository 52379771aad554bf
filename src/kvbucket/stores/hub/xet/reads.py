"""Reads of Xet-stored objects with plain HTTP: a cached reconstruction, then ranged fetches.

Why not hf_xet's streams for every read: a stream asks the CAS server for the file's
reconstruction and only then fetches, so a load after a lookup always costs two round trips,
and hf_xet offers no way to hand it a reconstruction asked for earlier. Here the reconstruction
of each lookup hit is asked for as soon as the lookup answers (all at once, cached briefly:
its fetch URLs are presigned and expire), so the load that follows is the fetches alone. The
bytes are read from the socket into a parse window and decoded from there straight into the
caller's buffer (:mod:`.decode`: compiled, without the GIL, or pure Python); nothing
touches the disk.

What is checked (the reconstruction is the server's word for what the file is): every fetched
range has the announced length; every chunk header has version 0, a known compression scheme
and lengths within bounds; every chunk decodes to its announced length; each term's chunks add
up to its ``unpacked_length`` and the terms to the file's size. Anything unexpected raises
:class:`XetReadUnsupported` or a ``StoreError``, and the caller falls back to hf_xet's own
stream (which does the same work the slow way).

Protocol (docs in ../shared/docs/hub-buckets-protocol.md; the CAS API's documented single-file
query): ``GET {casUrl}/v1/reconstructions/{file_hash}`` with the read token ->
``{offset_into_first_range, terms: [{hash, unpacked_length, range: {start, end}}],
fetch_info: {xorb: [{range: {start, end}, url, url_range: {start, end}}]}}``; chunk ranges are
end-exclusive, ``url_range`` is end-inclusive; ``GET url`` with ``Range: bytes=a-b`` returns the
serialized chunks: per chunk an 8-byte header ``[version u8][compressed_len u24][scheme u8]
[uncompressed_len u24]`` (little-endian), then the payload (scheme 0 none, 1 LZ4 frame, 2 byte
grouping 4 + LZ4).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import itertools
import json
import logging
import os
import queue
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvbucket.errors import AuthError, DeadlineExceededError, StoreError, TransientStoreError
from kvbucket.stores.deadline import REAPER, Gate, Watch, left
from kvbucket.stores.hub.xet import decode as xet_decode
from kvbucket.stores.hub.xet.decode import Window, XetReadUnsupported

log = logging.getLogger(__name__)

#: Fetch URLs are presigned and expire (an hour on the Hub today); a reconstruction is reused
#: for at most this long, and one whose fetch is refused is asked for again once.
RECONSTRUCTION_TTL_SECS = 60.0
#: Reconstructions kept at most (a few KiB each): several prompts' worth of chunks.
RECONSTRUCTION_CACHE_ENTRIES = 8192
#: Fetched bodies read and parsed at once, per reader, from a storage server on this machine.
#: Why a bound below the fetches in flight: every object of a batch is requested at once (one
#: round trip), but reading a body is CPU work under the GIL (socket reads, chunk parsing,
#: copies); 64 threads doing it at once on a 2-core machine spent their time handing the GIL
#: around (futex wake-ups, context switches). With two at a time, a 64 x 2 MiB load on the
#: emulator took 0.80-0.91x the time and 0.8x the client CPU (paired rounds, four runs).
#: Why only on loopback: over a network a socket nobody reads keeps its TCP receive window at
#: its initial size (Linux grows it as the application reads), so the sender stalls after a
#: few hundred KiB and each waiting body would later cost several round trips to ramp up: at
#: 50 ms, 64 bodies read four at a time would take seconds. There every body is read as it
#: arrives, the network being the bound.
READ_SLOTS = min(4, max(2, os.cpu_count() or 2))


#: Objects read with one fetch at most (and bytes: a run is read by one thread through one
#: socket, so a batch of a few large runs would be fewer streams than it has objects). Why runs:
#: per object, a fetch costs an HTTP request and response, a thread hand-off, a read slot and a
#: window set-up, on the client and on the server; 64 x 2 MiB loads on the emulator took 0.80-0.85x
#: the time and 0.82-0.86x the client CPU with runs of 4-16 (paired rounds, two runs).
RUN_OBJECTS = 8
RUN_BYTES = 16 << 20
#: How long a plan waits for the reconstructions it groups by (see XetReader.plan_runs).
RUN_PLAN_SECS = 1.0


@dataclass(frozen=True, slots=True)
class _Fetch:
    url: str
    first: int  # first byte (inclusive) and last byte (inclusive) of the ranged GET
    last: int
    chunk_start: int  # chunks [chunk_start, chunk_end) of the xorb that the range holds
    chunk_end: int
    #: the terms this range serves: (first chunk, end chunk (excl.), offset in the file, length)
    targets: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Reconstruction:
    fetches: tuple[_Fetch, ...]
    size: int
    expires: float


def parse_reconstruction(body: dict[str, Any], size: int, now: float) -> Reconstruction:
    """The fetches that rebuild a whole file of ``size`` bytes from a v1 reconstruction answer.

    A shape this reader does not know (fields missing or of other types) is
    :class:`XetReadUnsupported` (hf_xet reads it instead); values no reconstruction can hold (a
    negative length or offset, an empty or reversed range, a fetch that does not cover its
    chunks) are the server's error: a ``StoreError``, never a bare ``ValueError``."""
    if not isinstance(body, dict):
        raise StoreError(f"the storage answered a reconstruction with {type(body).__name__}, not an object")
    try:
        if _count(body.get("offset_into_first_range", 0), "offset_into_first_range") != 0:
            raise XetReadUnsupported("a whole-file reconstruction starting inside its first range")
        infos = body["fetch_info"]
        offset = 0
        plan: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}  # (xorb, fetch) -> terms
        for term in body["terms"]:
            xorb, cs, ce = str(term["hash"]), _count(term["range"]["start"]), _count(term["range"]["end"])
            length = _count(term["unpacked_length"], "unpacked_length")
            if ce <= cs:
                raise StoreError(f"the reconstruction names an empty chunk range {cs}-{ce} of xorb {xorb}")
            k = next((i for i, fi in enumerate(infos[xorb])
                      if _count(fi["range"]["start"]) <= cs and ce <= _count(fi["range"]["end"])), None)
            if k is None:
                raise XetReadUnsupported(f"no fetch covers chunks {cs}-{ce} of xorb {xorb}")
            plan.setdefault((xorb, k), []).append((cs, ce, offset, length))
            offset += length
        if offset != size:
            raise StoreError(f"the reconstruction describes {offset} bytes for a file of {size}")
        fetches = []
        for (xorb, k), terms in plan.items():
            fi = infos[xorb][k]
            first, last = _count(fi["url_range"]["start"]), _count(fi["url_range"]["end"])
            if last < first:
                raise StoreError(f"the reconstruction's byte range {first}-{last} of xorb {xorb} is reversed")
            fetches.append(_Fetch(str(fi["url"]), first, last, _count(fi["range"]["start"]),
                                  _count(fi["range"]["end"]), tuple(terms)))
        return Reconstruction(tuple(fetches), size, now + RECONSTRUCTION_TTL_SECS)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise XetReadUnsupported(f"unexpected reconstruction answer: {e!r}") from None


def _count(value: Any, what: str = "chunk or byte position") -> int:
    """A reconstruction's number: an int >= 0 (JSON has no other kind of length or position)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreError(f"the reconstruction's {what} is {value!r}, not a whole number")
    if value < 0:
        raise StoreError(f"the reconstruction's {what} is negative ({value})")
    return value


class _Connections:
    """Keep-alive HTTP(S) connections per host, reused between batches (no handshake per load)."""

    def __init__(self, size: int) -> None:
        self._idle: dict[tuple[str, str], queue.LifoQueue[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._size = size
        self._tls: ssl.SSLContext | None = None

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


class XetReader:
    """Reads whole objects by Xet hash. ``token(deadline, stale)`` returns the read token as
    ``(token, exp, cas_url)``, cached by the caller, a new one when the cached one is ``stale``;
    ``submit`` runs background work (the client's request threads)."""

    def __init__(self, token: Callable[[float | None, str | None], tuple[str, int, str]],
                 submit: Callable[..., Future[Any]], *, concurrency: int, request_timeout_secs: float,
                 headers: dict[str, str], read_slots: int = READ_SLOTS) -> None:
        self._token = token
        self._submit = submit
        self._timeout = request_timeout_secs
        self._headers = {k: v for k, v in headers.items() if k.lower() == "user-agent"}
        self._conns = _Connections(max(concurrency, 16))
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Reconstruction] = OrderedDict()
        # queries in flight: (future, the instant past which it is stuck and no longer joined)
        self._pending: dict[str, tuple[Future[Reconstruction], float]] = {}
        self._slots = threading.BoundedSemaphore(max(1, read_slots))  # bodies read at once
        self._windows: list[Window] = []  # one per slot in use, reused (LIFO: warm in cache)

    def tls(self) -> ssl.SSLContext:
        """The TLS context of every HTTPS connection of this reader (made on first call)."""
        return self._conns.tls()

    # ---- reconstructions -------------------------------------------------------------------
    def prefetch(self, files: list[tuple[str, int]], background: bool = False,
                 deadline: float | None = None) -> None:
        """Ask for the reconstruction of each (xet_hash, size) not cached yet, all at once, each
        query by ``deadline`` (default: ``request_timeout_secs`` from now).

        With ``background``, one request thread sends them, so a lookup returns as soon as its
        own answer is in: each query runs on a thread of its own, and in a fresh process
        starting 64 of them took the lookup 20-60 ms on a 2-core machine.
        """
        todo = [(h, size) for h, size in files if size > 0]
        until = deadline if deadline is not None else time.monotonic() + self._timeout
        if background and len(todo) > 1:
            try:
                self._submit(self.prefetch, todo, False, until)
                return
            except RuntimeError:  # closed: ask from here
                pass
        for h, size in todo:
            self._future(h, size, until)

    def _future(self, h: str, size: int, deadline: float | None) -> Future[Reconstruction]:
        """The object's reconstruction: cached, the query in flight, or a new query.

        A query in flight is joined only until its own deadline: past it, it is stuck (a
        server trickling its answer) and a new one is sent, so one slow answer never fails the
        later loads of the same object (a waiter that timed out drops it too: _read_into).
        """
        now = time.monotonic()
        until = deadline if deadline is not None else now + self._timeout
        with self._lock:
            rec = self._cache.get(h)
            if rec is not None and rec.expires > now:
                self._cache.move_to_end(h)
                done: Future[Reconstruction] = Future()
                done.set_result(rec)
                return done
            pending = self._pending.get(h)
            if pending is not None and pending[1] > now:
                return pending[0]
            fut: Future[Reconstruction] = Future()
            self._pending[h] = (fut, until)
        try:
            self._submit(self._query, h, size, until, fut)
        except RuntimeError:  # closed
            self._query(h, size, until, fut)
        return fut

    def _drop_pending(self, h: str, fut: Future[Reconstruction]) -> None:
        with self._lock:
            pending = self._pending.get(h)
            if pending is not None and pending[0] is fut:
                del self._pending[h]

    def _query(self, h: str, size: int, deadline: float, fut: Future[Reconstruction]) -> None:
        try:
            body: Any = None
            stale: str | None = None
            for attempt in (0, 1):
                token, _exp, cas = self._token(deadline, stale)
                status, data = self._get(f"{cas.rstrip('/')}/v1/reconstructions/{h}",
                                         {"Authorization": f"Bearer {token}"}, deadline)
                if status == 200:
                    try:
                        body = json.loads(data)
                    except ValueError as e:  # JSONDecodeError, bad UTF-8
                        raise StoreError(f"the storage's reconstruction answer is not JSON: {e}") from None
                    break
                if status == 401 and attempt == 0:
                    stale = token  # expired or revoked: ask for a new one, once
                    continue
                raise _status_error(status, "ask for an object's reconstruction")
            rec = parse_reconstruction(body, size, time.monotonic())
            with self._lock:
                self._cache[h] = rec
                while len(self._cache) > RECONSTRUCTION_CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            fut.set_result(rec)
        except BaseException as e:  # delivered to every waiter
            fut.set_exception(e)
        finally:
            self._drop_pending(h, fut)

    def _get(self, url: str, headers: dict[str, str], deadline: float) -> tuple[int, bytes]:
        """One GET on a warm connection: (status, body), by ``deadline`` (the socket is shut
        then, however the server trickles). Network failures are transient errors."""
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        timeout = max(0.001, min(self._timeout, left(deadline)))
        reusable = False
        conn: http.client.HTTPConnection | None = None
        watch = REAPER.watch(deadline)
        try:
            conn, resp = self._conns.send(parts.scheme, parts.netloc, timeout, target,
                                          {**self._headers, **headers}, watch)
            body = resp.read()
            reusable = not resp.will_close and not watch.fired
            return resp.status, body
        except (OSError, http.client.HTTPException) as e:
            why = f"{type(e).__name__}: {e}"
            if watch.fired:
                why = f"no whole answer by the deadline ({why})"
            raise TransientStoreError(f"asking the storage for a reconstruction failed: {why}") from None
        finally:
            REAPER.release(watch)
            if conn is not None and reusable:
                self._conns.put(parts.scheme, parts.netloc, conn)
            elif conn is not None:
                conn.close()

    def forget(self, h: str) -> None:
        with self._lock:
            self._cache.pop(h, None)

    # ---- reads ---------------------------------------------------------------------------
    def read_into(self, h: str, view: memoryview, gate: Gate | None, deadline: float) -> None:
        """Fill ``view`` (the whole object) with the object's bytes, by ``deadline``."""
        try:
            self._read_into(h, view, gate, deadline)
        except (TimeoutError, TransientStoreError) as e:
            if left(deadline) > 0 and not isinstance(e, TimeoutError):
                raise
            raise DeadlineExceededError(f"an object's bytes did not arrive in time ({e or 'no answer'})"
                                        ) from None

    def _read_into(self, h: str, view: memoryview, gate: Gate | None, deadline: float) -> None:
        size = view.nbytes
        for attempt in (0, 1):
            fut = self._future(h, size, deadline)
            try:
                rec = fut.result(timeout=max(0.001, left(deadline)))
            except TimeoutError:
                self._drop_pending(h, fut)  # stuck past a load's budget: later loads ask again
                raise
            try:
                for f in rec.fetches:
                    self._fetch(f, view, gate, deadline)
                return
            except _Refused:
                self.forget(h)  # presigned URLs expired: ask again, once
                if attempt:
                    raise StoreError("the storage refused the fetch URLs of a fresh reconstruction") from None

    def _fetch(self, f: _Fetch, view: memoryview, gate: Gate | None, deadline: float) -> None:
        self._fetch_run([(f, view, gate)], deadline, [0])

    def _fetch_run(self, reads: list[tuple[_Fetch, Any, Gate | None]], deadline: float,
                   done: list[int]) -> None:
        """One ranged GET for ``reads``, fetch ranges back to back in one xorb (one read: its own
        fetch), each laid out into its destination through its gate in turn; ``done[0]`` counts
        the reads finished whole, in order (so a caller that catches an error knows which)."""
        first, last = reads[0][0], reads[-1][0]
        parts = urlsplit(first.url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        timeout = max(0.001, min(self._timeout, left(deadline)))
        reusable = False
        conn: http.client.HTTPConnection | None = None
        watch = REAPER.watch(deadline)  # the fetch ends at the load's deadline, however slow the body
        try:
            headers = {**self._headers, "Range": f"bytes={first.first}-{last.last}"}
            conn, resp = self._conns.send(parts.scheme, parts.netloc, timeout, target, headers, watch)
            if resp.status in (401, 403):
                resp.read()
                raise _Refused()
            if resp.status not in (200, 206):
                resp.read()
                raise _status_error(resp.status, "fetch an object's bytes")
            asked = last.last - first.first + 1
            if resp.length is not None and resp.length != asked:
                raise StoreError(f"a fetch answered {resp.length} bytes for {asked} asked")
            slots = self._slots if _on_loopback(conn) else None
            if slots is not None and not slots.acquire(timeout=max(0.001, left(deadline))):
                raise TimeoutError("no read slot before the deadline")
            try:
                window = self._take_window()
                try:
                    for f, view, gate in reads:
                        xet_decode.copy_range(resp, f.last - f.first + 1, (f.chunk_start, f.chunk_end),
                                              f.targets, view, gate, window, xet_decode.ready(), lazy=True)
                        done[0] += 1
                finally:
                    self._give_window(window)
            finally:
                if slots is not None:
                    slots.release()
            reusable = not resp.will_close and resp.isclosed() and not watch.fired
        except (OSError, http.client.HTTPException) as e:
            raise TransientStoreError(f"fetching an object's bytes failed: {type(e).__name__}: {e}") from None
        finally:
            REAPER.release(watch)
            if conn is not None and reusable:
                self._conns.put(parts.scheme, parts.netloc, conn)
            elif conn is not None:
                conn.close()

    # ---- neighbours: one fetch for objects stored back to back ------------------------------------
    def plan_runs(self, files: list[tuple[str, int]], deadline: float) -> list[list[int]]:
        """Every index of ``files`` (xet_hash, size) once, grouped: objects whose single fetch
        ranges sit back to back in one xorb (objects stored together are packed so) make runs of
        up to ``RUN_OBJECTS`` objects and ``RUN_BYTES`` bytes, read by :meth:`read_run` with one
        request; the rest stand alone. Waits for the reconstructions at most ``RUN_PLAN_SECS``
        (an object whose answer is late stands alone: its own read waits for it, as before)."""
        futs = [self._future(h, size, deadline) if size > 0 else None for h, size in files]
        wait_futures([f for f in futs if f is not None], timeout=min(RUN_PLAN_SECS, left(deadline)))
        alone: list[list[int]] = []
        keyed: list[tuple[str, int, int, _Fetch]] = []
        for i, fut in enumerate(futs):
            rec = fut.result() if fut is not None and fut.done() and fut.exception() is None else None
            if rec is None or len(rec.fetches) != 1:
                alone.append([i])
                continue
            f = rec.fetches[0]
            keyed.append((f.url.split("?", 1)[0], f.first, i, f))
        keyed.sort(key=lambda t: (t[0], t[1]))
        runs: list[list[int]] = []
        prev: tuple[str, _Fetch] | None = None
        size = 0
        for base, _, i, f in keyed:
            n = f.last - f.first + 1
            if (prev is not None and prev[0] == base and prev[1].last + 1 == f.first
                    and len(runs[-1]) < RUN_OBJECTS and size + n <= RUN_BYTES):
                runs[-1].append(i)
                size += n
            else:
                runs.append([i])
                size = n
            prev = (base, f)
        return runs + alone

    def read_run(self, files: list[tuple[str, int, Any, Gate | None]], deadline: float) -> int:
        """Read back-to-back objects (xet_hash, size, whole-object destination, gate), as planned by
        :meth:`plan_runs`, with one fetch; how many, in order, were read whole. Never raises: an
        object not read whole (an error, a refused URL, a closed gate, the deadline) is left to
        its own read, which writes it again from its first byte.

        **Invariant (a run is its objects' own fetches, back to back).** Each object's bytes go
        through the same :func:`.decode.copy_range` into its own destination through its own
        gate, and count only once it returned (every term's length checked); the ranges asked for
        are the reconstructions' own, so the run's request asks for nothing else."""
        done = [0]
        try:
            reads = []
            for h, size, view, gate in files:
                rec = self._future(h, size, deadline).result(timeout=max(0.001, left(deadline)))
                if len(rec.fetches) != 1:
                    break
                reads.append((rec.fetches[0], view, gate))
            if any(a[0].last + 1 != b[0].first for a, b in itertools.pairwise(reads)):
                return 0  # planned from other reconstructions (expired and asked again meanwhile)
            if reads:
                self._fetch_run(reads, deadline, done)
        except Exception as e:  # the objects not read whole are read on their own
            log.debug("a run of %d objects stopped after %d: %s", len(files), done[0], e)
        return done[0]

    def _take_window(self) -> Window:
        """A parse window, reused (from a server on this machine the caller holds a read slot, so
        at most ``read_slots`` exist; over a network, one per body being read). Why not one per
        load thread: 64 threads held 128 MiB of them, each paying its first-touch page faults in
        a fresh process's first loads, and each cold in cache when used."""
        with self._lock:
            return self._windows.pop() if self._windows else Window()

    def _give_window(self, window: Window) -> None:
        with self._lock:
            self._windows.append(window)

    def close(self) -> None:
        self._conns.close()


def _on_loopback(conn: http.client.HTTPConnection) -> bool:
    """Whether the connection's peer is this machine (a loopback address): read slots apply.
    Asked once per connection (its socket's peer does not change), not per fetch."""
    known = getattr(conn, "_kvbucket_loopback", None)
    if known is not None and getattr(conn, "_kvbucket_sock", None) is conn.sock:
        return bool(known)
    near = _peer_is_loopback(conn)
    with contextlib.suppress(AttributeError):  # a connection class with __slots__: asked every time
        conn._kvbucket_loopback, conn._kvbucket_sock = near, conn.sock  # type: ignore[attr-defined]
    return near


def _peer_is_loopback(conn: http.client.HTTPConnection) -> bool:
    try:
        host = conn.sock.getpeername()[0]  # type: ignore[union-attr]
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except (AttributeError, OSError, ValueError, TypeError, IndexError):
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


class _Refused(Exception):
    """The storage refused a fetch URL (expired presigned URL)."""


def _status_error(status: int, what: str) -> Exception:
    if status in (401, 403):
        return AuthError(f"the storage refused to {what} (HTTP {status}); check the token's read access")
    if status in (408, 429) or status >= 500:
        return TransientStoreError(f"the storage did not answer usefully to {what} (HTTP {status})")
    if status == 404:
        return XetReadUnsupported(f"HTTP 404 trying to {what}")
    return StoreError(f"the storage answered HTTP {status} to {what}")


__all__ = ["Reconstruction", "XetReadUnsupported", "XetReader", "parse_reconstruction"]
