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

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import obstore
import pycurl

from kvbucket.chunks import as_view
from kvbucket.stores.base import Scatter
from kvbucket.stores.s3.kept import OVERLONG, ConnectionWatch

_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
# A batch is signed right before its requests go out; the URLs only need to outlive the batch.
URL_LIFETIME = timedelta(minutes=15)
MISSING = "missing"  # 404 NoSuchKey: the object is not there
RETRY = "retry"  # let obstore do this one
EXPIRED = "expired"  # the batch's deadline passed before this item finished
UNANSWERED = "unanswered"  # ``answer_by`` passed without an answer to any request of the batch
_ERROR_BODY_MAX = 64 * 1024
_RECV_BUFFER = 512 * 1024  # libcurl's receive buffer (its write callbacks still get <= 16 KiB)
#: A sealed payload's checksum is fed this many bytes at a time (from the caller's buffer, still
#: in cache): one GIL-releasing call per 256 KiB instead of a call per 16 KiB frame.
HASH_STEP = 256 * 1024
#: Threads (each with its own libcurl multi handle) one large ``fetch`` is split across.
READ_THREADS = min(4, max(2, os.cpu_count() or 1))
#: A batch is split only into parts of at least this many bytes (known from the buffers).
SPLIT_BYTES = 32 << 20


@dataclass(frozen=True)
class Body:
    """A body received whole: ``data`` is the caller's buffer or a new bytearray."""

    size: int
    data: Any
    etag: str | None = None


@dataclass(frozen=True)
class WrongSize:
    """The object has ``size`` bytes but the caller's buffer another size; the buffer is untouched."""

    size: int


Outcome = Body | WrongSize | str


@dataclass
class _Transfer:
    url: str
    view: memoryview | None  # the caller's buffer (writable bytes), or None: allocate one
    head: bool = False  # a HEAD: only the status and Content-Length matter
    status: int = 0
    headed: bool = False  # a whole header block arrived: the server answers
    closing: bool = False  # the server said it closes the connection after this answer
    suspect: bool = False  # sent on a connection found holding unasked bytes (kept.py): not trusted
    announced: int = -1
    pos: int = 0
    data: Any = None
    wrong_size: bool = False
    error_body: bytearray = field(default_factory=bytearray)
    etag: str | None = None  # a HEAD's: the version eviction deletes (S3Store.delete_versions)
    # Into a sealed object's payload once the header has landed: (payload view, header size,
    # hasher, the Scatter, the payload's address); see _fast_path.
    fast: tuple[memoryview, int, Any, Scatter, int] | None = None

    def header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):  # a new response (after 100-continue or a redirect)
            parts = line.split(None, 2)
            self.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            self.announced = -1
            self.closing = line.startswith(b"HTTP/1.0")  # 1.0 keeps a connection only if it says so
        elif line[:15].lower() == b"content-length:":
            value = line[15:].strip()
            self.announced = int(value) if value.isdigit() else -1
        elif self.head and line[:5].lower() == b"etag:":
            self.etag = line[5:].strip().decode("latin-1") or None
        elif line[:11].lower() == b"connection:":
            value = line[11:].lower()
            self.closing = b"close" in value or (self.closing and b"keep-alive" not in value)
        elif line in (b"\r\n", b"\n"):
            self.headed = True

    def write(self, chunk: bytes) -> int | None:
        """libcurl's write callback; returning 0 aborts the transfer (CURLE_WRITE_ERROR)."""
        fast = self.fast
        if fast is not None:  # the hot path: a frame of a sealed payload, in order (16 per 256 KiB)
            pos = self.pos
            end = pos + len(chunk)
            if end > self.announced:
                return 0
            payload, off, hasher, dst, base = fast
            _memmove(base + pos - off, chunk, end - pos)  # in bounds: end <= announced = off + payload
            self.pos = end
            hashed = dst.hashed  # the hash trails the bytes by < HASH_STEP (never claims more)
            if end - hashed >= HASH_STEP or end == self.announced:
                hasher.update(payload[hashed - off : end - off])  # in cache; releases the GIL
                dst.hashed = end
            return None
        if self.status != 200:
            if len(self.error_body) < _ERROR_BODY_MAX:
                self.error_body += chunk[: _ERROR_BODY_MAX - len(self.error_body)]
            return None
        if self.data is None:  # first body byte: check the announced size before writing any
            if self.announced < 0:
                return 0
            if self.view is None:
                self.data = bytearray(self.announced)
                self.view = memoryview(self.data)
            elif self.view.nbytes != self.announced:
                self.wrong_size = True
                return 0
            else:
                self.data = self.view
        n = len(chunk)
        end = self.pos + n
        if end > self.announced:  # never write past what was announced (or past the buffer)
            return 0
        assert self.view is not None
        self.view[self.pos : end] = chunk
        self.pos = end
        if type(self.view) is Scatter:
            self.fast = _fast_path(self.view, end)
        return None

    def outcome(self, curl_ok: bool, original: Any) -> Outcome:
        if self.head:  # a HEAD 404 has no body; the bucket itself was checked by S3Store._ready
            if curl_ok and self.status == 200 and self.announced >= 0:
                return Body(self.announced, None, self.etag)
            return MISSING if curl_ok and self.status == 404 else RETRY
        if self.wrong_size:
            return WrongSize(self.announced)
        if self.status == 404 and curl_ok and b"<Code>NoSuchKey</Code>" in self.error_body:
            return MISSING
        if not curl_ok or self.status != 200 or self.announced < 0 or self.pos != self.announced:
            return RETRY
        if self.announced == 0:  # no write callback ran for an empty body
            if self.view is None:
                return Body(0, bytearray())
            if self.view.nbytes != 0:
                return WrongSize(0)
            return Body(0, original)
        return Body(self.announced, original if original is not None else self.data)


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
    ) -> None:
        self._store = store
        self._max_parallel = max(1, max_parallel)
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
        """GET every URL, up to ``max_parallel`` at once; one outcome per URL, in order.

        ``buffers[i]`` is the caller's buffer for item ``i`` (any writable contiguous buffer) or
        None. A buffer that cannot be written (read-only, not contiguous) gets :data:`RETRY` so
        ``S3Store``'s own checks word the error.

        A batch of at least ``2 * SPLIT_BYTES`` (by its buffers' sizes) is split, item ``i`` to
        part ``i % k``, across ``k`` threads (up to ``READ_THREADS``, this one included), each
        with its own multi handle and a share of ``max_parallel``. It returns when every part
        has: no transfer of the batch writes into a buffer after that.
        """
        groups = self._groups(buffers)
        if len(groups) < 2:
            return self._batch(urls, buffers, False, deadline, answer_by)
        progress = _Progress(answer_by is None)
        limit = -(-self._max_parallel // len(groups))

        def part(idx: list[int]) -> tuple[list[int], list[Outcome]]:
            return idx, self._batch([urls[i] for i in idx], [buffers[i] for i in idx], False, deadline,
                                    answer_by, progress, limit)

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

    def _groups(self, buffers: Sequence[Any | None]) -> list[list[int]]:
        n = len(buffers)
        total = sum(_size(b) for b in buffers)
        k = min(self._threads, n, total // SPLIT_BYTES)
        return [list(range(j, n, k)) for j in range(k)] if k >= 2 else [list(range(n))]

    def _workers(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads - 1, thread_name_prefix="kvbucket-s3-read")
            return self._pool

    def head(self, urls: Sequence[str], deadline: float | None = None) -> list[Outcome]:
        """HEAD every URL: :class:`Body` (size, no data), :data:`MISSING` on 404, else :data:`RETRY`."""
        return self._batch(urls, [None] * len(urls), True, deadline)

    def _batch(
        self, urls: Sequence[str], buffers: Sequence[Any | None], head: bool, deadline: float | None,
        answer_by: float | None = None, progress: _Progress | None = None, limit: int | None = None,
    ) -> list[Outcome]:
        if self._closed:
            return [RETRY] * len(urls)
        session = self._borrow()
        try:
            return self._run(session, urls, buffers, head, deadline, answer_by, progress, limit)
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
        if pool is not None:
            pool.shutdown(wait=False)
        for s in sessions:
            s.close()

    # ---- machinery ------------------------------------------------------------------------
    def _run(
        self, session: _Session, urls: Sequence[str], buffers: Sequence[Any | None], head: bool,
        deadline: float | None, answer_by: float | None = None, progress: _Progress | None = None,
        limit: int | None = None,
    ) -> list[Outcome]:
        out: list[Outcome] = [RETRY] * len(urls)
        # Has any request of the batch (every part of a split one) had an answer (its headers)?
        progress = progress if progress is not None else _Progress(answer_by is None)
        max_parallel = limit or self._max_parallel
        unanswered = False
        transfers: dict[int, tuple[int, _Transfer, pycurl.Curl]] = {}
        pending = list(range(len(urls)))
        pending.reverse()  # pop() from the end keeps request order
        multi = session.multi

        def start_next() -> None:
            while pending and len(transfers) < max_parallel:
                i = pending.pop()
                view = _writable_view(buffers[i])
                if view is False:
                    continue  # RETRY: S3Store's checks report it
                t = _Transfer(urls[i], view if view is not None else None, head)
                c = session.easy(head)
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
                transfers[id(c)] = (i, t, c)
                multi.add_handle(c)

        def finish(c: pycurl.Curl, ok: bool) -> None:
            i, t, _ = transfers.pop(id(c))
            if t.headed:
                progress.answered = True
            out[i] = t.outcome(ok, buffers[i])
            if ok and session.watch.finished(c, t.url, t.status, t.closing, transfers.values()):
                out[i] = OVERLONG  # more bytes than announced: refused, the connection given up
            elif t.suspect and isinstance(out[i], Body):
                out[i] = RETRY  # its connection may have held another answer's excess (kept.py)
            multi.remove_handle(c)
            # Drop references to the caller's buffer before the handle is reused.
            c.setopt(pycurl.WRITEFUNCTION, _discard)
            c.setopt(pycurl.HEADERFUNCTION, _discard)
            session.free[head].append(c)

        start_next()
        try:
            while transfers:
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
                    elif answer_by is not None and now >= answer_by:
                        unanswered = True  # not one answer's headers: the server is not answering
                        break
                start_next()
                if transfers:
                    waits = (deadline, None if progress.answered else answer_by)
                    bounds = [b for b in waits if b is not None]
                    multi.select(max(0.0, min(0.5, min(bounds, default=now + 0.5) - time.monotonic())))
        finally:
            # After an exception or at the deadline: drop what is still running (never reused).
            for i, _t, c in list(transfers.values()):
                multi.remove_handle(c)
                c.close()
                out[i] = RETRY
            transfers.clear()
        if unanswered:
            out = [UNANSWERED if o == RETRY else o for o in out]
        elif deadline is not None:
            out = [EXPIRED if o == RETRY and time.monotonic() >= deadline else o for o in out]
        return out

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


def _fast_path(dst: Scatter, pos: int) -> tuple[memoryview, int, Any, Scatter, int] | None:
    """Write straight into ``dst``'s second part from ``pos`` on, when that is all a
    :meth:`Scatter.__setitem__` would do there: two parts (a sealed header and the payload),
    a running hash that has reached ``pos``, and ``pos`` past the header. One Python call per
    frame instead of two, and its copy made by ``memmove`` through ctypes, which releases the
    GIL (a slice assignment copies holding it: 0.1 s per GiB). The payload's address stays valid:
    ``fast`` holds its view, and a Scatter that allows redirects never gets here."""
    parts = dst.parts
    if (len(parts) == 2 and dst.hasher is not None and not dst.rewritten and dst.hashed == pos
            and parts[0].nbytes <= pos and not dst.redirectable and not parts[1].readonly):
        base = np.frombuffer(parts[1], np.uint8).ctypes.data if parts[1].nbytes else 0
        return parts[1], parts[0].nbytes, dst.hasher, dst, base
    return None


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
