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

import http.client
import itertools
import json
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any
from urllib.parse import urlsplit

from kvbucket.errors import AuthError, DeadlineExceededError, StoreError, TransientStoreError
from kvbucket.stores.deadline import REAPER, Gate, left
from kvbucket.stores.hub.xet import decode as xet_decode
from kvbucket.stores.hub.xet.connections import Connections as _Connections
from kvbucket.stores.hub.xet.decode import Window, XetReadUnsupported
from kvbucket.stores.hub.xet.plans import (
    MIN_PART_BYTES,
    RECONSTRUCTION_TTL_SECS,
    Fetch,
    Part,
    Reconstruction,
    join_parts,
    parse_part,
    parse_reconstruction,
    part_ranges,
    replan_part,
)
from kvbucket.stores.hub.xet.retries import BACKOFF_SECS, RETRIES, retried
from kvbucket.stores.hub.xet.turns import Turns, default_slots
from kvbucket.stores.part_sizes import part_size
from kvbucket.threads import ForkSafeSemaphore

_Fetch = Fetch  # the name tests and older callers know

log = logging.getLogger(__name__)

#: Reconstructions kept at most (a few KiB each): several prompts' worth of chunks.
RECONSTRUCTION_CACHE_ENTRIES = 8192
#: Fetched bodies parsed at once, per reader (``read_slots``; 0: no bound, each as it arrives):
#: turns taken only while a body's bytes are already here (turns.py says why and what it keeps).
#: The default is one per core, at least 4 (at most 4 while the Python decoder is in use). It
#: applies whoever the peer is: no behaviour of the read path depends on the peer being this
#: machine, so what a benchmark on loopback or through testing/shaped_link.py measures is what
#: users run (docs/hfbucket.md, "Parse turns", has both).
READ_SLOTS = default_slots()
#: Ranged GETs in flight at once per reader (``read_connections``): a load's fetches, its runs'
#: and its big objects' parts. A real link caps each connection (object stores and CDNs at ~100
#: MB/s), so a load fills a link only with many at once; objects are grouped in runs only when
#: they outnumber this (see plan_runs). Measured: docs/hfbucket.md, "What bounds a hit on a real
#: link".
READ_CONNECTIONS = 64
#: Objects of at least twice this are read in parts of about this many bytes, each its own
#: reconstruction (asked at once with the others) and its own fetches, in parallel
#: (``read_part_bytes``; 0: never split). A load whose fetches would be fewer than
#: ``read_connections`` reads in smaller parts, down to ``read_min_part_bytes`` (plans.py).
PART_BYTES = 8 << 20
#: Parse windows kept for reuse (more are made while more bodies are read at once, then dropped).
KEPT_WINDOWS = 8


#: Objects read with one fetch at most (and bytes: a run is read by one thread through one
#: socket, so a batch of a few large runs would be fewer streams than it has objects); runs are
#: made only when a load's objects outnumber ``read_connections`` (see plan_runs). Why runs:
#: per object, a fetch costs an HTTP request and response, a thread hand-off, a read slot and a
#: window set-up, on the client and on the server; 64 x 2 MiB loads on the emulator took 0.80-0.85x
#: the time and 0.82-0.86x the client CPU with runs of 4-16 (paired rounds, two runs).
RUN_OBJECTS = 8
RUN_BYTES = 16 << 20
#: How long a plan waits for the reconstructions it groups by (see XetReader.plan_runs).
RUN_PLAN_SECS = 1.0


class XetReader:
    """Reads whole objects by Xet hash. ``token(deadline, stale)`` returns the read token as
    ``(token, exp, cas_url)``, cached by the caller, a new one when the cached one is ``stale``;
    ``submit`` runs background work (the client's request threads)."""

    def __init__(self, token: Callable[[float | None, str | None], tuple[str, int, str]],
                 submit: Callable[..., Future[Any]], *, concurrency: int, request_timeout_secs: float,
                 headers: dict[str, str], read_slots: int = READ_SLOTS, connections: int = READ_CONNECTIONS,
                 part_bytes: int = PART_BYTES, min_part_bytes: int = MIN_PART_BYTES,
                 retries: int = RETRIES, retry_backoff_secs: float = BACKOFF_SECS) -> None:
        self._token = token
        # each reconstruction and fetch retried on its own (retries.py): the first wait is short
        self._retries = max(0, retries)
        self._backoff = min(BACKOFF_SECS, max(0.0, retry_backoff_secs))
        self._submit = submit
        self._timeout = request_timeout_secs
        self._headers = {k: v for k, v in headers.items() if k.lower() == "user-agent"}
        self._conns = _Connections(max(concurrency, connections, 16))
        self._connections = max(1, connections)
        self._budget = ForkSafeSemaphore(self._connections)  # ranged GETs in flight (whole in a fork)
        self._part_bytes = max(0, part_bytes)
        self._min_part_bytes = max(0, min_part_bytes)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Reconstruction] = OrderedDict()
        # queries in flight: (future, the instant past which it is stuck and no longer joined)
        self._pending: dict[str, tuple[Future[Reconstruction], float]] = {}
        self._turns = Turns(read_slots) if read_slots > 0 else None  # parse turns (turns.py)
        self._windows: list[Window] = []  # reused (LIFO: warm in cache), up to KEPT_WINDOWS

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

        **Invariant (a load's parts are sized to the budget where they are asked).** The files
        asked for together are one load (or the lookup before it): their part size is
        :func:`~kvbucket.stores.part_sizes.part_size` of all of them against ``read_connections``,
        so a load whose fetches would be fewer than the budget reads in smaller parts, down to
        ``read_min_part_bytes``; each part is its own reconstruction (a CAS request) tiling the
        object (plans.join_parts). Decided here once per reconstruction, not per read: a read of
        an object whose reconstruction is cached uses its parts, whatever the load (any tiling
        writes the same bytes), and one asked elsewhere (expired, refused) has parts of
        ``read_part_bytes``.
        """
        todo = [(h, size) for h, size in files if size > 0]
        until = deadline if deadline is not None else time.monotonic() + self._timeout
        if background and len(todo) > 1:
            try:
                self._submit(self.prefetch, todo, False, until)
                return
            except RuntimeError:  # closed: ask from here
                pass
        part = part_size([n for _, n in todo], self._connections, self._part_bytes, self._min_part_bytes)
        for h, size in todo:
            self._future(h, size, until, part)

    def _future(self, h: str, size: int, deadline: float | None,
                part: int | None = None) -> Future[Reconstruction]:
        """The object's reconstruction: cached, the query in flight, or a new query (in parts of
        about ``part`` bytes, default ``read_part_bytes``).

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
        ranges = part_ranges(size, self._part_bytes if part is None else part)
        if len(ranges) > 1:
            self._query_parts(h, size, ranges, until, fut)
            return fut
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

    def _ask(self, h: str, deadline: float, rng: tuple[int, int] | None = None) -> Any:
        """The reconstruction answer (parsed JSON) of the file, or of bytes ``[a, b)`` of it."""
        stale: str | None = None
        for attempt in (0, 1):
            token, _exp, cas = self._token(deadline, stale)
            headers = {"Authorization": f"Bearer {token}"}
            if rng is not None:
                headers["Range"] = f"bytes={rng[0]}-{rng[1] - 1}"
            status, data = self._get(f"{cas.rstrip('/')}/v1/reconstructions/{h}", headers, deadline)
            if status in (200, 206):
                try:
                    return json.loads(data)
                except ValueError as e:  # JSONDecodeError, bad UTF-8
                    raise StoreError(f"the storage's reconstruction answer is not JSON: {e}") from None
            if status == 401 and attempt == 0:
                stale = token  # expired or revoked: ask for a new one, once
                continue
            raise _status_error(status, "ask for an object's reconstruction")
        raise AssertionError("unreachable")

    def _asked(self, h: str, deadline: float, rng: tuple[int, int] | None = None) -> Any:
        """:meth:`_ask`, sent again on its own when it fails transiently (retries.py)."""
        return retried(lambda: self._ask(h, deadline, rng), "a reconstruction", retries=self._retries,
                       backoff=self._backoff, deadline=deadline)

    def _keep(self, h: str, rec: Reconstruction) -> None:
        with self._lock:
            self._cache[h] = rec
            while len(self._cache) > RECONSTRUCTION_CACHE_ENTRIES:
                self._cache.popitem(last=False)

    def _resolve(self, h: str, fut: Future[Reconstruction], make: Callable[[], Reconstruction]) -> None:
        """``fut`` gets what ``make`` returns (kept in the cache) or raises, for every waiter."""
        try:
            rec = make()
            self._keep(h, rec)
            fut.set_result(rec)
        except BaseException as e:  # delivered to every waiter
            fut.set_exception(e)
        finally:
            self._drop_pending(h, fut)

    def _query(self, h: str, size: int, deadline: float, fut: Future[Reconstruction]) -> None:
        self._resolve(h, fut, lambda: parse_reconstruction(self._asked(h, deadline), size, time.monotonic()))

    def _query_parts(self, h: str, size: int, ranges: list[tuple[int, int]], deadline: float,
                     fut: Future[Reconstruction]) -> None:
        """Ask for the reconstruction of each range of a big object at once (one request thread
        each, none waiting for another: the last answer joins them, plans.join_parts)."""
        parts: list[Part | None] = [None] * len(ranges)
        errors: list[BaseException] = []
        todo = [len(ranges)]
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                parts[i] = parse_part(self._asked(h, deadline, ranges[i]), ranges[i][0])
            except BaseException as e:
                errors.append(e)
            with lock:
                todo[0] -= 1
                if todo[0]:
                    return
            self._resolve(h, fut, joined)

        def joined() -> Reconstruction:
            if errors:
                raise errors[0]
            return join_parts([p for p in parts if p is not None], size, time.monotonic(), ranges)

        for i in range(len(ranges)):
            try:
                self._submit(one, i)
            except RuntimeError:  # closed
                one(i)

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
            reusable = not REAPER.release(watch) and reusable  # the reaper's answer, not fired's
            if conn is not None and reusable:
                self._conns.put(parts.scheme, parts.netloc, conn)
            elif conn is not None:
                conn.close()

    def forget(self, h: str) -> None:
        with self._lock:
            self._cache.pop(h, None)

    # ---- reads ---------------------------------------------------------------------------
    def read_into(self, h: str, view: memoryview, gate: Gate | None, deadline: float) -> None:
        """Fill ``view`` (the whole object) with the object's bytes, by ``deadline`` (counted in
        decode.reading while it runs: a big hit waits for the compiled decoder)."""
        try:
            with xet_decode.reading(view.nbytes):
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
                self._fetch_all(rec, h, view, gate, deadline)
                return
            except _Refused:
                self.forget(h)  # presigned URLs expired: ask again, once
                if attempt:
                    raise StoreError("the storage refused the fetch URLs of a fresh reconstruction") from None

    def _fetch(self, f: Fetch, view: memoryview, gate: Gate | None, deadline: float) -> None:
        """One fetch of an object, sent again on its own when it fails transiently (retries.py:
        it writes its own bytes again, through the same gate)."""
        retried(lambda: self._fetch_run([(f, view, gate)], deadline, [0]), "a fetch", retries=self._retries,
                backoff=self._backoff, deadline=deadline)

    def _fetch_owned(self, h: str, rec: Reconstruction, j: int, view: memoryview, gate: Gate | None,
                     deadline: float) -> None:
        """Fetch ``j`` of ``rec``. Its URL refused (expired) in an object read in parts: its part
        alone is asked for again and fetched from the fresh answer (plans.replan_part: the same
        bytes), the other parts kept; elsewhere the refusal is raised (the object is asked again)."""
        try:
            self._fetch(rec.fetches[j], view, gate, deadline)
            return
        except _Refused:
            if not rec.parts:
                raise
        self.forget(h)  # its other URLs are as old: the next load asks for the object again
        k = rec.owners[j]
        a, b = rec.parts[k][:2]
        for f in replan_part(rec, k, parse_part(self._asked(h, deadline, (a, b)), a)):
            try:
                self._fetch(f, view, gate, deadline)
            except _Refused:
                raise StoreError("the storage refused the fetch URLs of a fresh reconstruction") from None

    def _fetch_all(self, rec: Reconstruction, h: str, view: memoryview, gate: Gate | None,
                   deadline: float) -> None:
        """Every fetch of an object at once (its parts, or its xorbs' ranges): one on this thread,
        the others on request threads. Returns once every one has ended (no fetch of it writes
        into ``view`` after that, unless the deadline passed: then the gate, closed by the
        store, stops it); the first error is raised, a refused URL first of all. Each fetch is
        retried on its own first (:meth:`_fetch`), so a transient failure of one part costs that
        part again, not the object."""
        fetches = rec.fetches
        if len(fetches) == 1:
            self._fetch_owned(h, rec, 0, view, gate, deadline)
            return
        # **Invariant (an object's parallel fetches write one at a time).** Each writes only its
        # own bytes (plans.join_parts), and every write of a read goes through its one Gate,
        # whose lock serializes them: a Scatter's running hash and redirect bookkeeping, which
        # assume one writer, still see one. A read without a gate gets one of its own here.
        gate = gate if gate is not None else Gate()
        futs: list[Future[Any]] = []
        errors: list[BaseException] = []
        for j in range(1, len(fetches)):
            try:
                futs.append(self._submit(self._fetch_owned, h, rec, j, view, gate, deadline))
            except RuntimeError:  # closed: fetched here, after the first
                futs.append(Future())
                futs[-1].set_running_or_notify_cancel()
                try:
                    self._fetch_owned(h, rec, j, view, gate, deadline)
                    futs[-1].set_result(None)
                except BaseException as e:
                    futs[-1].set_exception(e)
        try:
            self._fetch_owned(h, rec, 0, view, gate, deadline)
        except BaseException as e:
            errors.append(e)
        done, late = wait_futures(futs, timeout=max(0.001, left(deadline)))
        errors += [e for fu in done if (e := fu.exception()) is not None]
        if late:
            errors.append(TimeoutError("a part of an object did not arrive in time"))
        refused = [e for e in errors if isinstance(e, _Refused)]
        if refused or errors:
            raise (refused or errors)[0]

    def _fetch_run(self, reads: list[tuple[Fetch, Any, Gate | None]], deadline: float,
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
        resp: http.client.HTTPResponse | None = None
        if not self._budget.acquire(timeout=max(0.001, left(deadline))):
            raise TimeoutError("no connection of the read budget (read_connections) before the deadline")
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
            fast = xet_decode.ready()
            turns = self._turns
            turn = turns.turn(deadline, resp, conn.sock, fast is not None) if turns is not None else None
            try:
                if turn is not None:
                    turn.take()
                window = self._take_window()
                try:
                    for f, view, gate in reads:
                        xet_decode.copy_range(resp, f.last - f.first + 1, (f.chunk_start, f.chunk_end),
                                              f.targets, view, gate, window, fast, lazy=True,
                                              turn=turn)
                        done[0] += 1
                finally:
                    self._give_window(window)
            finally:
                if turn is not None:
                    turn.end()
            reusable = not resp.will_close and resp.isclosed() and not watch.fired
        except (OSError, http.client.HTTPException, TransientStoreError) as e:
            if watch.fired and not isinstance(e, TimeoutError):  # shut by the reaper: an early end
                raise _cut(resp, first, last) from None
            if isinstance(e, TransientStoreError):
                raise
            raise TransientStoreError(f"fetching an object's bytes failed: {type(e).__name__}: {e}") from None
        finally:
            reusable = not REAPER.release(watch) and reusable  # the reaper's answer, not fired's
            self._budget.release()
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
        (an object whose answer is late stands alone: its own read waits for it, as before).

        **Invariant (runs never leave the link short of fetches).** A run is at most
        ``ceil(objects / read_connections)`` objects: a load of no more objects than the budget
        is one fetch per object, and one of more still keeps about ``read_connections`` fetches
        in flight (a real link caps each connection: fewer, longer fetches would be slower)."""
        per_run = min(RUN_OBJECTS, -(-len(files) // self._connections))
        if per_run < 2:
            return [[i] for i in range(len(files))]
        futs = [self._future(h, size, deadline) if size > 0 else None for h, size in files]
        wait_futures([f for f in futs if f is not None], timeout=min(RUN_PLAN_SECS, left(deadline)))
        alone: list[list[int]] = []
        keyed: list[tuple[str, int, int, Fetch]] = []
        for i, fut in enumerate(futs):
            rec = fut.result() if fut is not None and fut.done() and fut.exception() is None else None
            if rec is None or len(rec.fetches) != 1:
                alone.append([i])
                continue
            f = rec.fetches[0]
            keyed.append((f.url.split("?", 1)[0], f.first, i, f))
        keyed.sort(key=lambda t: (t[0], t[1]))
        runs: list[list[int]] = []
        prev: tuple[str, Fetch] | None = None
        size = 0
        for base, _, i, f in keyed:
            n = f.last - f.first + 1
            if (prev is not None and prev[0] == base and prev[1].last + 1 == f.first
                    and len(runs[-1]) < per_run and size + n <= RUN_BYTES):
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
            with xet_decode.reading(sum(size for _, size, _, _ in files)):
                self._read_run(files, deadline, done)
        except Exception as e:  # the objects not read whole are read on their own
            log.debug("a run of %d objects stopped after %d: %s", len(files), done[0], e)
        return done[0]

    def _read_run(self, files: list[tuple[str, int, Any, Gate | None]], deadline: float,
                  done: list[int]) -> None:
        """:meth:`read_run`'s work: ``done[0]`` counts the objects read whole, in order."""
        reads = []
        for h, size, view, gate in files:
            rec = self._future(h, size, deadline).result(timeout=max(0.001, left(deadline)))
            if len(rec.fetches) != 1:
                break
            reads.append((rec.fetches[0], view, gate))
        if any(a[0].last + 1 != b[0].first for a, b in itertools.pairwise(reads)):
            return  # planned from other reconstructions (expired and asked again meanwhile)
        if reads:
            self._fetch_run(reads, deadline, done)

    def _take_window(self) -> Window:
        """A parse window, reused (one per body being read; with read slots, at most one per
        slot). Why not one per load thread: 64 threads held 128 MiB of them, each paying its
        first-touch page faults in a fresh process's first loads, and each cold in cache when
        used; at most ``KEPT_WINDOWS`` are kept between loads."""
        with self._lock:
            if self._windows:
                return self._windows.pop()
        return Window()  # made outside the lock: its pages are touched by whoever reads into it

    def _give_window(self, window: Window) -> None:
        with self._lock:
            if len(self._windows) < KEPT_WINDOWS:
                self._windows.append(window)

    def close(self) -> None:
        self._conns.close()


def _cut(resp: http.client.HTTPResponse | None, first: Fetch, last: Fetch) -> TransientStoreError:
    """The error of a fetch whose connection the reaper shut at the load's deadline: late (a
    transient error, retried while time is left), never reported as bad bytes."""
    asked = last.last - first.first + 1
    n = None if resp is None else resp.length  # what http.client has still to read
    got = "" if n is None else f"; {asked - n} of its {asked} bytes had arrived"
    return TransientStoreError(f"fetching an object's bytes was cut at the load's deadline{got}")


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


__all__ = ["MIN_PART_BYTES", "PART_BYTES", "READ_CONNECTIONS", "READ_SLOTS", "RECONSTRUCTION_TTL_SECS",
           "Reconstruction", "XetReadUnsupported", "XetReader", "parse_reconstruction"]
