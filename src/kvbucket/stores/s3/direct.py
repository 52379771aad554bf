"""Direct reads for ``S3Store``: batches of GETs (and HEADs) presigned by obstore, run by libcurl.

Why: obstore hands a body over as Rust-owned frames that ``S3Store`` then copies into the
caller's buffer, one Python call per frame, and a thread of our pool per request. Measured on
loopback (``benchmarks/bench_s3.py``, ``benchmarks/bench_l2.py``), a batch of GETs on libcurl's
multi interface (pycurl) in the calling thread costs half the client CPU per request: headers are
parsed in C, connections are kept and re-tried by libcurl, and each body is written straight
into the caller's buffer as it arrives (16-32 KiB per libcurl write callback). With the server
on the same cores, client CPU is throughput. obstore still does what a proven S3 client must:
credentials (static, session, refreshed by its providers) and SigV4, as presigned URLs signed
locally, one call per batch.

Only the happy path lives here: status 200 with a ``Content-Length``. A GET's 404 whose body
says ``NoSuchKey``, or any HEAD's 404, is a miss (one request). Anything else (an error status, a
body cut short, a timeout, TLS trouble) comes back as :data:`RETRY` and ``S3Store`` repeats that
item through obstore, which owns retries, backoff and error messages; an answer longer than
its Content-Length is :data:`OVERLONG` (refused, its connections never reused: kept.py). A batch
given a deadline stops there: transfers still running are dropped (libcurl writes only inside
``perform``, in the calling thread, so a dropped transfer never writes into its buffer again) and answer
:data:`EXPIRED`. A batch given ``answer_by`` also stops there if no request of it has had an answer
yet (the status and headers of one response: the server is hung), its items :data:`UNANSWERED`.
Presigned URLs carry the access key id
and a signature (never the secret) and are never logged or put in errors.

What holds the GIL here is the write callback: libcurl hands each body over in frames of at most
16 KiB (``CURL_MAX_WRITE_SIZE``, whatever ``CURLOPT_BUFFERSIZE`` is: 99.7% of callbacks were
16,384 bytes with a 512 KiB buffer), 65,536 Python calls per GiB, each a copy into the caller's
buffer. So a large batch is split across a few threads, each running its own multi handle
(libcurl's work, the sockets and parsing, runs with the GIL released and so on several cores),
and a sealed payload's checksum is fed per 256 KiB from the buffer it landed in (xxhash releases
the GIL for it) instead of once per frame.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any

import obstore
import pycurl

from kvbucket.chunks import as_view
from kvbucket.stores.base import Scatter
from kvbucket.stores.part_sizes import part_floor, part_ranges
from kvbucket.stores.s3.kept import OVERLONG, ConnectionWatch
from kvbucket.stores.s3.split import MIN_PART_BYTES, join_ranges, part_size, where
from kvbucket.stores.s3.transfers import (
    CLOSED,
    EXPIRED,
    HASH_STEP,
    MISSING,
    RETRY,
    UNANSWERED,
    Body,
    Outcome,
    Slots,
    WrongSize,
    _Transfer,
)

_log = logging.getLogger(__name__)

# A batch is signed right before its requests go out; the URLs only need to outlive the batch.
URL_LIFETIME = timedelta(minutes=15)
_RECV_BUFFER = 512 * 1024  # libcurl's receive buffer (its write callbacks still get <= 16 KiB)
#: Threads (each with its own libcurl multi handle) one large ``fetch`` is split across.
READ_THREADS = min(4, max(2, os.cpu_count() or 1))
#: A batch is split only into parts of at least this many bytes (known from the buffers).
SPLIT_BYTES = 32 << 20
#: An object of at least twice this (known from its caller's flat buffer) is read with ranged
#: GETs of about this many bytes, in parallel (``s3_read_part_bytes``; 0: one GET per object), as
#: awscrt's S3 client does: a real link caps each connection (S3 at ~100 MB/s), so one GET of a
#: big object takes its size over one connection's cap however fast the link. Smaller parts (down
#: to ``s3_read_min_part_bytes``) when a load has fewer than ``max_parallel`` of them: split.py.
PART_BYTES = 8 << 20


class _Session:
    """One libcurl multi handle with its easy handles; its connection cache outlives batches
    (a connection that delivered more than it announced is cut: kept.py)."""

    def __init__(self, setup: dict[int, Any]) -> None:
        self.multi = pycurl.CurlMulti()
        self.setup = setup
        self.free: dict[bool, list[pycurl.Curl]] = {False: [], True: []}  # GET / HEAD handles
        self.watch = ConnectionWatch()

    def easy(self, head: bool) -> pycurl.Curl:
        if self.free[head]:
            return self.free[head].pop()
        c = pycurl.Curl()
        for opt, value in self.setup.items():
            c.setopt(opt, value)
        if head:
            c.setopt(pycurl.NOBODY, 1)
        return c

    def close(self) -> None:
        for handles in self.free.values():
            for c in handles:
                c.close()
            handles.clear()
        self.multi.close()


class DirectReader:
    """Presigned GETs for ``S3Store.get_many``; batches run in the caller's thread."""

    def __init__(
        self,
        store: Any,
        *,
        ca_bundle: str | None,
        timeout: float,
        connect_timeout: float,
        max_parallel: int,
        threads: int = READ_THREADS,
        part_bytes: int = PART_BYTES,
        min_part_bytes: int = MIN_PART_BYTES,
    ) -> None:
        self._store = store
        self._max_parallel = max(1, max_parallel)
        #: Transfers in flight across every call on this reader (``s3_num_io_threads``): each
        #: holds a slot from start to end, so concurrent loads share the budget instead of each
        #: having it (4 threads loading at once had 35 GETs at the server with a budget of 16).
        #: close() wakes the calls waiting for one (they end with CLOSED, sending nothing).
        self._slots = Slots(self._max_parallel)
        self._part_bytes = max(0, part_bytes)
        self._min_part_bytes = max(0, min_part_bytes)
        self._threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        setup: dict[int, Any] = {
            pycurl.NOSIGNAL: 1,  # we run in worker threads
            pycurl.BUFFERSIZE: _RECV_BUFFER,
            pycurl.TCP_NODELAY: 1,
            pycurl.CONNECTTIMEOUT_MS: int(connect_timeout * 1000),
            pycurl.TIMEOUT_MS: int(timeout * 1000),
            pycurl.FOLLOWLOCATION: 0,
            pycurl.PROXY: "",  # never an environment proxy: S3Store sends proxied setups to obstore
            pycurl.HTTP_VERSION: pycurl.CURL_HTTP_VERSION_1_1,
        }
        if ca_bundle:
            setup[pycurl.CAINFO] = ca_bundle
        else:
            try:
                import certifi

                setup[pycurl.CAINFO] = certifi.where()
            except ImportError:  # libcurl's compiled-in default store
                pass
        self._setup = setup
        self._lock = threading.Lock()
        self._idle: list[_Session] = []
        self._closed = False
        #: Objects whose ranges carried different ETags (written during the load): read again whole.
        self.mixed_versions = 0
        #: Set once a split object's ranges all came without an ETag (some S3-compatible servers, a
        #: proxy stripping it): one version cannot be proven, so every split load read it twice
        #: (ranges, then whole); this reader's loads then read objects whole, one GET each.
        self.whole_only = False

    @property
    def slots(self) -> Slots:
        """The store's transfer budget, also taken by its fallbacks through obstore (fallbacks.py)."""
        return self._slots

    def sign(self, names: Sequence[str], method: str = "GET") -> list[str] | None:
        """Presigned URLs for ``names`` (relative to the store's prefix); None if the store can't."""
        try:
            return list(obstore.sign(self._store, method, list(names), URL_LIFETIME))  # type: ignore[arg-type]
        except Exception:  # e.g. a credential provider failing: obstore's own path reports it
            return None

    def fetch(
        self, urls: Sequence[str], buffers: Sequence[Any | None], deadline: float | None = None,
        answer_by: float | None = None,
    ) -> list[Outcome]:
        """GET every URL (big objects in ranges, see :data:`PART_BYTES`); one outcome per URL.

        **Invariant (the ranges of an object write disjoint bytes that tile it).** An object is
        split only into a caller's flat writable buffer whose size it must have; each range's
        transfer writes into its own slice of it, and only a 206 whose Content-Range names exactly
        that range of an object of that size (anything else: its bytes are never written, and the
        object is :data:`WrongSize` or repeated whole by obstore, which rewrites every byte). The
        object counts as read only when every range did (``split.join_ranges``).

        **Invariant (the ranges of an object are one version of it).** Ranges go out in parallel,
        so ``If-Match`` cannot tie the later ones to the first; instead every 206 names its
        version (ETag), and the object counts as read only when every range of it carries the same
        non-empty ETag (``split.join_ranges``). A writer replacing a same-size object between two
        ranges otherwise made a hit of two versions' bytes (raw reads have no checksum to catch
        it); ranges of different versions make the object :data:`RETRY`: one GET through obstore,
        one version, every byte rewritten (counted in ``mixed_versions``). Ranges without any
        ETag (the server's or a proxy's way) do the same once, then ``whole_only``.
        """
        plan = self._ranges(buffers)
        if not plan:
            return self._closing(self._fetch(urls, buffers, deadline, answer_by))
        u2: list[str] = []
        b2: list[Any] = []
        r2: list[tuple[int, int, int] | None] = []
        owner: list[int] = []
        for i, (url, buf) in enumerate(zip(urls, buffers, strict=True)):
            spans = plan.get(i)
            if spans is None:
                u2.append(url)
                b2.append(buf)
                r2.append(None)
                owner.append(i)
                continue
            view = spans[0]
            for a, b in spans[1]:
                u2.append(url)
                b2.append(view)
                r2.append((a, b, view.nbytes))
                owner.append(i)
        got = self._fetch(u2, b2, deadline, answer_by, r2, owner, buffers)
        out, mixed, untagged = join_ranges(got, owner, buffers, plan)
        if untagged and not self.whole_only:
            self.whole_only = True
            _log.warning("%s answers ranged GETs without an ETag, so an object read in ranges cannot be "
                         "proven one version and is read again whole: this store now reads objects whole "
                         "(one GET each, s3_read_part_bytes unused)", where(urls[0]))
        if mixed:
            with self._lock:
                self.mixed_versions += mixed
            _log.debug("%d object(s) read in ranges of different versions (overwritten during the "
                       "load): read again whole", mixed)
        return self._closing(out)

    def _closing(self, out: list[Outcome]) -> list[Outcome]:
        """``out``, where the reader was closed meanwhile with every item not read :data:`CLOSED`
        (``S3Store`` then reports it closed, never repeating it through obstore)."""
        return [CLOSED if o == RETRY else o for o in out] if self._closed else out

    def _ranges(self, buffers: Sequence[Any | None]) -> dict[int, tuple[Any, list[tuple[int, int]]]]:
        """Items to read in ranges: their writable buffer (a flat view or a Scatter) and ``[a, b)``
        ranges, sized so that about ``max_parallel`` GETs are in flight (split.py)."""
        if self._part_bytes <= 0 or self.whole_only:
            return {}
        smallest = part_floor(self._part_bytes, self._min_part_bytes)
        views: dict[int, Any] = {}
        for i, buf in enumerate(buffers):
            view = _writable_view(buf) if buf is not None and _size(buf) >= 2 * smallest else None
            if view is not None and view is not False:
                views[i] = view
        whole = len(buffers) - len(views)  # one GET each, a connection each
        part = part_size([v.nbytes for v in views.values()], self._max_parallel - whole, self._part_bytes,
                         self._min_part_bytes)
        out: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for i, view in views.items():
            tiles = part_ranges(view.nbytes, part)
            if len(tiles) > 1:
                out[i] = (view, tiles)
        return out

    def _fetch(
        self, urls: Sequence[str], buffers: Sequence[Any | None], deadline: float | None = None,
        answer_by: float | None = None, ranges: Sequence[tuple[int, int, int] | None] | None = None,
        owner: Sequence[int] | None = None, objects: Sequence[Any | None] | None = None,
    ) -> list[Outcome]:
        """GET every URL, up to ``max_parallel`` at once; one outcome per URL, in order.

        ``buffers[i]`` is the caller's buffer for item ``i`` (any writable contiguous buffer) or
        None. A buffer that cannot be written (read-only, not contiguous) gets :data:`RETRY` so
        ``S3Store``'s own checks word the error.

        A batch of at least ``2 * SPLIT_BYTES`` (by its buffers' sizes) is split, item ``i`` to
        part ``i % k``, across ``k`` threads (up to ``READ_THREADS``, this one included), each
        with its own multi handle and a share of ``max_parallel``. It returns when every part
        has: no transfer of the batch writes into a buffer after that. The ranges of one object
        (``owner``: the object of each URL, ``objects`` their buffers) stay on one thread: their
        writes into a Scatter (its running hash) then come one at a time.
        """
        groups = self._groups(objects if objects is not None else buffers, owner)
        if len(groups) < 2:
            return self._batch(urls, buffers, False, deadline, answer_by, ranges=ranges)
        progress = _Progress(answer_by is None)
        limit = -(-self._max_parallel // len(groups))

        def part(idx: list[int]) -> tuple[list[int], list[Outcome]]:
            return idx, self._batch([urls[i] for i in idx], [buffers[i] for i in idx], False, deadline,
                                    answer_by, progress, limit, [ranges[i] for i in idx] if ranges else None)

        pool = self._workers()
        futures = [pool.submit(part, g) for g in groups[1:]] if pool is not None else []
        parts: list[tuple[list[int], list[Outcome]]] = []
        error: BaseException | None = None
        try:
            parts.append(part(groups[0]) if pool is not None else (groups[0], [RETRY] * len(groups[0])))
        except BaseException as e:  # wait for the other parts first: they write into the buffers
            error = e
        for f in futures:
            try:
                parts.append(f.result())
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
        out: list[Outcome] = [RETRY] * len(urls)
        for idx, got in parts:
            for i, o in zip(idx, got, strict=True):
                out[i] = o
        return out

    def _groups(self, objects: Sequence[Any | None], owner: Sequence[int] | None = None) -> list[list[int]]:
        """Items per thread: object ``i`` (and every range of it) to thread ``i % k``."""
        n = len(objects)
        total = sum(_size(b) for b in objects)
        k = min(self._threads, n, total // SPLIT_BYTES)
        own = owner if owner is not None else range(n)
        if k < 2:
            return [list(range(len(own)))]
        return [g for g in ([j for j, o in enumerate(own) if o % k == m] for m in range(k)) if g]

    def _workers(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads - 1, thread_name_prefix="kvbucket-s3-read")
            return self._pool

    def head(self, urls: Sequence[str], deadline: float | None = None) -> list[Outcome]:
        """HEAD every URL: :class:`Body` (size, no data), :data:`MISSING` on 404, else :data:`RETRY`."""
        return self._closing(self._batch(urls, [None] * len(urls), True, deadline))

    def _batch(
        self, urls: Sequence[str], buffers: Sequence[Any | None], head: bool, deadline: float | None,
        answer_by: float | None = None, progress: _Progress | None = None, limit: int | None = None,
        ranges: Sequence[tuple[int, int, int] | None] | None = None,
    ) -> list[Outcome]:
        if self._closed:
            return [RETRY] * len(urls)
        session = self._borrow()
        try:
            return self._run(session, urls, buffers, head, deadline, answer_by, progress, limit, ranges)
        finally:
            self._give_back(session)

    def conditional(self, method: str, url: str, if_match: str) -> int:
        """One ``method`` request to a presigned ``url`` with ``If-Match``, on a new connection;
        its status (``S3Store.delete_versions``: 204 removed, 412 someone wrote it since)."""
        c = pycurl.Curl()
        try:
            for opt, value in self._setup.items():
                c.setopt(opt, value)
            c.setopt(pycurl.URL, url)
            c.setopt(pycurl.CUSTOMREQUEST, method)
            c.setopt(pycurl.HTTPHEADER, [f"If-Match: {if_match}"])
            c.setopt(pycurl.FRESH_CONNECT, 1)
            c.setopt(pycurl.FORBID_REUSE, 1)
            c.setopt(pycurl.WRITEFUNCTION, _discard)
            c.perform()
            return int(c.getinfo(pycurl.RESPONSE_CODE))
        finally:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sessions, self._idle = self._idle, []
            pool, self._pool = self._pool, None
        self._slots.close()  # calls waiting for a transfer slot end now, sending nothing
        if pool is not None:
            pool.shutdown(wait=False)
        for s in sessions:
            s.close()

    # ---- machinery ------------------------------------------------------------------------
    def _run(
        self, session: _Session, urls: Sequence[str], buffers: Sequence[Any | None], head: bool,
        deadline: float | None, answer_by: float | None = None, progress: _Progress | None = None,
        limit: int | None = None, ranges: Sequence[tuple[int, int, int] | None] | None = None,
    ) -> list[Outcome]:
        out: list[Outcome] = [RETRY] * len(urls)
        # Has any request of the batch (every part of a split one) had an answer (its headers)?
        progress = progress if progress is not None else _Progress(answer_by is None)
        max_parallel = limit or self._max_parallel
        unanswered = sent = False
        transfers: dict[int, tuple[int, _Transfer, pycurl.Curl]] = {}
        pending = list(range(len(urls)))
        pending.reverse()  # pop() from the end keeps request order
        multi = session.multi
        slots = self._slots
        watch = session.watch

        def prereq(t: _Transfer, _ip: str, _local_ip: str, _port: int, local_port: int) -> int:
            return watch.prereq(t, local_port)

        def start_next(held: bool = False) -> None:
            """Start transfers while this call has room and the reader a slot (``held``: one
            already taken for the first)."""
            nonlocal held_slot, sent
            held_slot = held
            while pending and len(transfers) < max_parallel and not self._closed:
                view = _writable_view(buffers[pending[-1]])
                if view is False:
                    pending.pop()
                    continue  # RETRY: S3Store's checks report it
                if not held_slot:
                    if not slots.acquire(blocking=False):
                        break  # the reader's budget is in use by other calls: wait for a slot
                    held_slot = True
                i = pending.pop()
                sent = True
                t = _Transfer(urls[i], view if view is not None else None, head)
                c = session.easy(head)
                rng = ranges[i] if ranges else None
                if rng is not None:
                    t.rng, t.base, t.whole = (rng[0], rng[1]), rng[0], rng[2]
                    c.setopt(pycurl.RANGE, f"{rng[0]}-{rng[1] - 1}")
                else:
                    c.setopt(pycurl.RANGE, None)
                # libcurl's own bounds, cut to what is left of the batch's deadline.
                total, connect = self._setup[pycurl.TIMEOUT_MS], self._setup[pycurl.CONNECTTIMEOUT_MS]
                if deadline is not None:
                    rest = max(1, int(1000 * (deadline - time.monotonic())))
                    total, connect = min(total, rest), min(connect, rest)
                c.setopt(pycurl.TIMEOUT_MS, total)
                c.setopt(pycurl.CONNECTTIMEOUT_MS, connect)
                c.setopt(pycurl.URL, t.url)
                c.setopt(pycurl.HEADERFUNCTION, t.header)
                c.setopt(pycurl.WRITEFUNCTION, t.write)
                c.setopt(pycurl.SOCKOPTFUNCTION, t.opened)
                c.setopt(pycurl.PREREQFUNCTION, partial(prereq, t))
                transfers[id(c)] = (i, t, c)  # holds the slot now (released by finish or finally)
                held_slot = False
                multi.add_handle(c)
            if held_slot:  # taken but not used (nothing left to start)
                held_slot = False
                slots.release()

        def finish(c: pycurl.Curl, ok: bool) -> None:
            i, t, _ = transfers.pop(id(c))
            slots.release()
            watch.release(t)  # its connection's record keeps no transfer past here (kept.py)
            if t.headed:
                progress.answered = True
            out[i] = t.outcome(ok, buffers[i])
            if ok and session.watch.finished(c, t, transfers.values()):
                out[i] = OVERLONG  # more bytes than announced: refused, the connection given up
            elif t.suspect and isinstance(out[i], Body):
                out[i] = RETRY  # its connection may have held another answer's excess (kept.py)
            multi.remove_handle(c)
            # Drop references to the caller's buffer before the handle is reused.
            c.setopt(pycurl.WRITEFUNCTION, _discard)
            c.setopt(pycurl.HEADERFUNCTION, _discard)
            c.setopt(pycurl.SOCKOPTFUNCTION, _sockopt_ok)
            c.setopt(pycurl.PREREQFUNCTION, _prereq_ok)
            session.free[head].append(c)

        held_slot = False
        try:
            start_next()
            while transfers or self._wait_slot(pending, deadline):
                if not transfers:  # holding no slot: wait for one (never past the deadline)
                    start_next(held=True)
                    continue
                ret, _running = multi.perform()
                if ret == pycurl.E_CALL_MULTI_PERFORM:
                    continue
                while True:
                    queued, done, failed = multi.info_read()
                    for c in done:
                        finish(c, True)
                    for c, _errno, _msg in failed:
                        finish(c, False)
                    if not queued:
                        break
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                if not progress.answered:
                    if any(t.headed for _, t, _ in transfers.values()):
                        progress.answered = True
                    elif answer_by is not None and now >= answer_by and sent:
                        unanswered = True  # not one answer's headers: the server is not answering
                        break
                start_next()
                if transfers:
                    waits = (deadline, None if progress.answered else answer_by)
                    bounds = [b for b in waits if b is not None]
                    multi.select(max(0.0, min(0.5, min(bounds, default=now + 0.5) - time.monotonic())))
        finally:
            # After an exception or at the deadline: drop what is still running (never reused).
            for i, t, c in list(transfers.values()):
                watch.release(t)
                multi.remove_handle(c)
                c.close()
                out[i] = RETRY
                slots.release()
            transfers.clear()
            if held_slot:
                slots.release()
        if unanswered:
            out = [UNANSWERED if o == RETRY else o for o in out]
        elif deadline is not None:
            out = [EXPIRED if o == RETRY and time.monotonic() >= deadline else o for o in out]
        return out

    def _wait_slot(self, pending: list[int], deadline: float | None) -> bool:
        """True once a slot of the reader's budget is held for this call's next transfer; False
        when nothing is left to start, at the deadline, or once the reader is closed."""
        while pending and not self._closed:
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                return False
            if self._slots.acquire(timeout=wait):
                return True
        return False

    def _borrow(self) -> _Session:
        with self._lock:
            session = self._idle.pop() if self._idle else None
        if session is None:
            return _Session(self._setup)
        session.watch.sweep()  # a kept connection with bytes waiting is cut, never reused (kept.py)
        return session

    def _give_back(self, session: _Session) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(session)
                return
        session.close()


class _Progress:
    """Shared by the parts of one batch: has any of its requests had an answer yet?"""

    __slots__ = ("answered",)

    def __init__(self, answered: bool) -> None:
        self.answered = answered


def _size(buf: Any | None) -> int:
    if buf is None:
        return 0
    n = getattr(buf, "nbytes", None)
    return int(n) if isinstance(n, int) else len(buf)


def _sockopt_ok(_fd: int, _purpose: int) -> int:
    return 0  # CURL_SOCKOPT_OK


def _prereq_ok(*_conn: object) -> int:
    return 0  # CURL_PREREQFUNC_OK


def _discard(_data: bytes) -> None:
    return None


def _writable_view(buf: Any | None) -> memoryview | bool | None:
    """A writable flat byte view of ``buf``; None for no buffer; False if it can't be written."""
    if buf is None:
        return None
    if isinstance(buf, Scatter):
        return buf  # type: ignore[return-value]  # written like a flat view (dst[a:b] = data)
    try:
        view = as_view(buf)  # numpy, torch and any C-contiguous buffer, without copying
    except (TypeError, ValueError):
        return False
    return False if view.readonly else view


__all__ = ["CLOSED", "EXPIRED", "HASH_STEP", "MISSING", "PART_BYTES", "RETRY", "UNANSWERED", "Body",
           "DirectReader", "Outcome", "WrongSize", "_Transfer"]
