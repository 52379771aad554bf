"""The Hugging Face Hub bucket calls HFBucketStore needs, with retries and clear errors.

Why not only ``HfApi``'s bucket methods? Measured on the emulator (benchmarks/bench_hfbucket.py):
``download_bucket_files`` asks paths-info and a resolve HEAD before every download and writes
each object to a file that must then be read back; ``get_bucket_paths_info`` spends most of its
time building dataclasses with parsed datetimes; ``batch_bucket_files`` hides the per-path
failure list and the xet hashes of what it uploaded. So this module speaks the same REST routes
through huggingface_hub's own HTTP session, headers, error classes and retry helper, and moves
bytes with the shared ``hf_xet`` session: uploads from caller memory, downloads streamed
straight into caller buffers through one long-lived download group. Everything that touches
huggingface_hub internals is in this file.

Deadlines (the rule is in docs/reliability.md): every request has a total deadline, not only
per-read timeouts, and no lock is held across a network call. httpx's timeouts are per connect
and per read, so a server that trickles a byte at a time never trips them: each request runs on
a daemon request thread and the caller stops waiting at the deadline (the thread is abandoned;
it ends with the request or the process), and a request pool with no thread free by a deadline
is replaced. The read token is fetched once for all the loads that need it, on a thread of its
own; each waits for it until its own deadline, and a fetch still running past the deadline of
the call that started it is no longer joined (the next caller sends a new one). Xet reads
(xet/reads.py) shut their sockets at the deadline.

Secrets: the Hub token and Xet CAS tokens live only in header dicts handed to the libraries;
error messages are built from status codes and server messages and pass through ``redact``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import quote

import httpx2
from huggingface_hub import HfApi, get_session
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

from kvbucket.errors import DeadlineExceededError, StoreError, TransientStoreError
from kvbucket.secrets import redact
from kvbucket.stores.deadline import Gate, deadline_in, left, run_abandonable
from kvbucket.stores.hub.errors import HubContext, connection_refused, hub_error
from kvbucket.stores.hub.files import RemoteFile, remote_file
from kvbucket.stores.hub.xet.compression import batch_policy
from kvbucket.stores.hub.xet.reads import (
    MIN_PART_BYTES,
    PART_BYTES,
    READ_CONNECTIONS,
    READ_SLOTS,
    XetReader,
    XetReadUnsupported,
)
from kvbucket.stores.hub.xet.sessions import (
    UploadCommits,
    download_session,
    hold_download_session,
    release_download_session,
)
from kvbucket.stores.hub.xet.tokens import TOKEN_SAFETY_SECS, Token, XetToken
from kvbucket.stores.hub.xet.uploads import UploadStaging
from kvbucket.threads import DaemonThreadPool

log = logging.getLogger(__name__)

#: The Hub accepts at most this many operations (batch) or paths (paths-info) per request.
HUB_BATCH_LIMIT = 1000
_MAX_WAIT = 8.0
_REQUEST_THREADS = 64  # requests in flight at once per bucket client (threads start as needed)
_REQUEST_THREAD_NAME = "kvbucket-hub-request"

T = TypeVar("T")


class HubBucketClient:
    """One bucket on one Hub endpoint, authenticated with one token (or none)."""

    def __init__(
        self,
        *,
        endpoint: str,
        bucket_id: str,
        token: str | None,
        token_source: str,
        max_retries: int = 5,
        retry_backoff_secs: float = 0.5,
        connect_timeout_secs: float = 2.0,
        request_timeout_secs: float = 30.0,
        load_concurrency: int = 64,
        xet_compression: str = "auto",
        read_connections: int = READ_CONNECTIONS,
        read_part_bytes: int = PART_BYTES,
        read_min_part_bytes: int = MIN_PART_BYTES,
        read_slots: int = READ_SLOTS,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.bucket_id = bucket_id
        self._token = token
        self._token_source = token_source  # words naming where the token came from, never the value
        self.max_retries = max_retries
        self.retry_backoff_secs = retry_backoff_secs
        self.connect_timeout_secs = connect_timeout_secs
        self.request_timeout_secs = request_timeout_secs
        from kvbucket import __version__

        # token=None lets huggingface_hub fall back to $HF_TOKEN / the saved login, as it does.
        self._headers = build_hf_headers(token=token, library_name="kvbucket", library_version=__version__)
        self._api = HfApi(endpoint=self.endpoint, token=token, library_name="kvbucket",
                          library_version=__version__)
        # huggingface_hub makes its process-wide HTTP client on first use, and that loads a CA
        # bundle into a TLS context (30-90 ms of CPU in a fresh process). Made here, when the
        # store is opened, rather than by the first lookup, on the inference path. (Its
        # build_hf_headers already makes it, unless HF_HUB_DISABLE_TELEMETRY is set.)
        get_session()
        self._base = f"{self.endpoint}/api/buckets/{bucket_id}"
        self._xet_lock = threading.Lock()
        self._write_token = XetToken(lambda until: self._fetch_token("write", until),
                                     "a write token for the bucket's storage", request_timeout_secs)
        self._compression = xet_compression
        self._commits = UploadCommits(f"{self._base}/xet-write-token", self._headers,
                                      safety_secs=TOKEN_SAFETY_SECS, compression=xet_compression)
        self._read_token = XetToken(lambda until: self._fetch_token("read", until),
                                    "a read token for the bucket's storage", request_timeout_secs)
        self._group_lock = threading.Lock()  # one group made at a time (see _group)
        self._warming = False
        self._download_group: Any = None
        self._holds_session = False  # this client counts in the shared download session's users
        self.load_concurrency = load_concurrency
        self._requests = DaemonThreadPool(_REQUEST_THREADS, _REQUEST_THREAD_NAME)  # see _bounded
        self.direct_reads = True  # plain-HTTP reads with cached reconstructions (xet/reads.py)
        self._reader = XetReader(
            self._reader_token, lambda *a: self._requests.submit(*a), concurrency=load_concurrency,
            request_timeout_secs=request_timeout_secs, headers=self._headers, read_slots=read_slots,
            connections=read_connections, part_bytes=read_part_bytes, min_part_bytes=read_min_part_bytes,
            retries=max_retries, retry_backoff_secs=retry_backoff_secs,
        )
        if self.endpoint.startswith("https:"):
            self._reader.tls()  # the storage is HTTPS too: its reads' TLS context, made now as well

    def __repr__(self) -> str:
        return f"HubBucketClient({redact(self.endpoint)!r}, {self.bucket_id!r})"

    # ---- error mapping --------------------------------------------------------------------
    def _secrets(self) -> list[str]:
        s = [self._token] if self._token else []
        for tok in (self._write_token.current, self._read_token.current):
            if tok:
                s.append(tok[0])
        return [x for x in s if x]

    def error(self, exc: BaseException, what: str) -> StoreError:
        """Translate any exception of a Hub/Xet call into a kvbucket error a user can act on."""
        return hub_error(exc, what, HubContext(
            redact(self.endpoint), self.bucket_id, self._token_source, "authorization" not in self._headers,
            self.max_retries), self._secrets())

    def _request(self, method: str, url: str, timeout: httpx2.Timeout, **kwargs: Any) -> httpx2.Response:
        # One attempt here: :meth:`retrying` owns the retry policy (one budget, Retry-After honoured).
        return http_backoff(
            method, url, headers=kwargs.pop("headers", self._headers), max_retries=0,
            retry_on_exceptions=(), retry_on_status_codes=(), timeout=timeout, **kwargs,
        )

    def _timeout(self, deadline: float | None) -> httpx2.Timeout:
        """One request's timeouts: the configured ones, cut to what is left of the call's budget."""
        request, connect = self.request_timeout_secs, self.connect_timeout_secs
        if deadline is not None:
            rest = max(0.001, left(deadline))
            request, connect = min(request, rest), min(connect, rest)
        return httpx2.Timeout(request, connect=connect)

    def retrying(self, fn: Callable[[httpx2.Timeout], T], what: str, deadline: float | None = None,
                 *, bounded: bool = True) -> T:
        """Run ``fn(timeout)`` with exponential backoff on transient failures; raise a kvbucket error.

        With a ``deadline`` (a monotonic instant) every attempt's timeouts are cut to the time
        left, each attempt ends at the deadline however slowly the server answers (on a request
        thread, see the module docstring; ``bounded=False`` for an ``fn`` that bounds itself),
        and no retry starts (or sleeps) past it: the call fails with
        :class:`DeadlineExceededError` instead.
        """
        delay = self.retry_backoff_secs
        err: StoreError | None = None
        for attempt in range(self.max_retries + 1):
            if deadline is not None and left(deadline) <= 0:
                break
            try:
                if deadline is None or not bounded:
                    return fn(self._timeout(deadline))
                return self._bounded(fn, self._timeout(deadline), deadline, what)
            except Exception as e:  # classified below
                err = self.error(e, what)
                # nobody listens (refused): a retry 0.5-8 s later would only delay the error
                if not isinstance(err, TransientStoreError) or attempt == self.max_retries or \
                        connection_refused(e):
                    raise err from None
                wait = min(delay, _MAX_WAIT)
                retry_after = getattr(getattr(e, "response", None), "headers", {}).get("Retry-After", "")
                if isinstance(retry_after, str) and retry_after.strip().isdigit():
                    wait = min(float(retry_after), _MAX_WAIT)
                if deadline is not None and wait >= left(deadline):
                    break
                log.debug("retrying %s on bucket %s in %.2fs after: %s", what, self.bucket_id, wait, err)
                time.sleep(wait)
                delay *= 2
        raise DeadlineExceededError(
            f"the Hub did not answer in time for bucket {self.bucket_id!r} while trying to {what}"
            + (f" (last error: {err})" if err is not None else "")
        )

    def _bounded(self, fn: Callable[[httpx2.Timeout], T], t: httpx2.Timeout, deadline: float, what: str) -> T:
        """``fn(t)`` on a request thread; the caller stops waiting at ``deadline``.

        Called on a request thread already, it runs on a thread of its own (queued behind the
        request threads that wait for it, it could not start). Past the deadline the request
        is abandoned, and so is the pool if the request was still running (stuck on the
        server) or never started (no thread of the pool came free within the whole budget):
        later requests get fresh threads instead of queueing behind stuck ones.
        """
        if threading.current_thread().name.startswith(_REQUEST_THREAD_NAME):
            return run_abandonable(lambda: fn(t), deadline, lambda: DeadlineExceededError(
                f"the Hub did not answer in time for bucket {self.bucket_id!r} while trying to {what} "
                "(the request was abandoned at the call's deadline)"))
        pool = self._requests
        try:
            fut = pool.submit(fn, t)
        except RuntimeError:  # shut down by close()
            raise StoreError(f"the client of bucket {self.bucket_id!r} is closed") from None
        try:
            return fut.result(timeout=left(deadline))
        except FutureTimeout:
            fut.cancel()  # queued: never sent
            with self._xet_lock:
                replaced = self._requests is pool
                if replaced:
                    self._requests = DaemonThreadPool(_REQUEST_THREADS, _REQUEST_THREAD_NAME)
            if replaced:
                pool.shutdown(wait=False)
                log.debug("request pool of %s replaced: a request passed its deadline", self.bucket_id)
            raise DeadlineExceededError(
                f"the Hub did not answer in time for bucket {self.bucket_id!r} while trying to {what} "
                "(the request was abandoned at the call's deadline)"
            ) from None

    # ---- bucket --------------------------------------------------------------------------
    def bucket_info(self, deadline: float | None = None) -> dict[str, Any]:
        def call(t: httpx2.Timeout) -> dict[str, Any]:
            r = self._request("GET", self._base, t)
            hf_raise_for_status(r)
            return dict(r.json())

        return self.retrying(call, "read the bucket's info", deadline)

    def create_private(self, deadline: float | None = None) -> None:
        """Create the bucket as private; an existing bucket is left as it is (409 is success)."""

        def create() -> None:
            try:
                self._api.create_bucket(self.bucket_id, private=True, exist_ok=True)
            except HfHubHTTPError as e:
                if getattr(e.response, "status_code", None) == 409:
                    return
                raise

        def call(t: httpx2.Timeout) -> None:  # HfApi takes no timeout: abandoned at the deadline
            run_abandonable(create, deadline_in(t.read or self.request_timeout_secs),
                            lambda: TimeoutError("creating the bucket timed out"))

        self.retrying(call, "create the bucket", deadline)

    # ---- metadata ------------------------------------------------------------------------
    def paths_info(self, paths: Sequence[str], deadline: float | None = None, with_mtime: bool = False
                   ) -> dict[str, RemoteFile]:
        """Exact size and hash of each existing path (absent = missing); one request per 1,000.

        The JSON is read directly (no datetime parsing unless ``with_mtime``): this is the hot path
        of lookups.
        """
        out: dict[str, RemoteFile] = {}
        for i in range(0, len(paths), HUB_BATCH_LIMIT):
            chunk = list(paths[i : i + HUB_BATCH_LIMIT])

            def call(t: httpx2.Timeout, chunk: list[str] = chunk) -> list[dict[str, Any]]:
                r = self._request("POST", f"{self._base}/paths-info", t, json={"paths": chunk})
                hf_raise_for_status(r)
                return list(r.json())

            for entry in self.retrying(call, "look up objects in the bucket", deadline):
                f = remote_file(entry, with_mtime)
                if f is not None:
                    out[f.path] = f
        return out

    def list_tree(self, directory: str) -> Iterator[RemoteFile]:
        """Every file under ``directory`` (recursive, paginated by the Hub, fetched lazily).

        Each page, retries included, is bounded by ``request_timeout_secs``.
        """
        url: str | None = f"{self._base}/tree" + (f"/{quote(directory, safe='')}" if directory else "")
        params: dict[str, Any] | None = {"recursive": "true"}
        while url is not None:

            def call(t: httpx2.Timeout, url: str = url, params: dict[str, Any] | None = params
                     ) -> httpx2.Response:
                r = self._request("GET", url, t, params=params)
                if r.status_code == 404 and r.headers.get("X-Error-Code") == "EntryNotFound":
                    return r
                hf_raise_for_status(r)
                return r

            r = self.retrying(call, "list the bucket", deadline_in(self.request_timeout_secs))
            if r.status_code == 404:
                return
            for entry in r.json():
                f = remote_file(entry, with_mtime=True)
                if f is not None:
                    yield f
            url = r.links.get("next", {}).get("url")
            params = None

    # ---- writes --------------------------------------------------------------------------
    def commit_batch(self, ops: Sequence[dict[str, Any]], deadline: float | None = None,
                     what: str = "commit a batch of writes") -> dict[str, str]:
        """POST one NDJSON batch (<= 1,000 operations); return ``{path: error}`` of failed ones.

        Retried on 429/5xx/timeouts: addFile with a given hash and deleteFile are idempotent.
        """
        if len(ops) > HUB_BATCH_LIMIT:
            raise ValueError(f"a batch holds at most {HUB_BATCH_LIMIT} operations, got {len(ops)}")
        body = b"".join(json.dumps(op).encode() + b"\n" for op in ops)

        def call(t: httpx2.Timeout) -> dict[str, str]:
            r = self._request("POST", f"{self._base}/batch", t, content=body,
                              headers={"Content-Type": "application/x-ndjson", **self._headers})
            if r.status_code in (200, 422):
                try:
                    failed = r.json().get("failed", []) if r.content else []
                except ValueError:
                    failed = []
                if failed or r.status_code == 200:
                    return {str(f.get("path")): str(f.get("error", "failed")) for f in failed}
            hf_raise_for_status(r)
            return {}

        return self.retrying(call, what, deadline)

    def _fetch_token(self, kind: str, until: float) -> Token:
        """Ask the Hub for a new Xet token (``kind``: read or write), retried until ``until``. On
        the token's own thread (xet/tokens.py), so not through the request pool: its waiters are
        bounded by their deadlines."""

        def call(t: httpx2.Timeout) -> Token:
            r = self._request("GET", f"{self._base}/xet-{kind}-token", t)
            hf_raise_for_status(r)
            d = r.json()
            return str(d["accessToken"]), int(d["exp"]), str(d["casUrl"])

        return self.retrying(call, f"get a {kind} token for the bucket's storage", until, bounded=False)

    def upload(
        self, items: Sequence[tuple[str, Any]], deadline: float | None = None
    ) -> list[tuple[str, int]]:
        """Upload the bytes of each (path, buffer) to Xet storage; return (xet_hash, size) in order.

        Nothing is visible in the bucket until :meth:`commit_batch` adds the paths. With a
        ``deadline`` the commit runs on a daemon thread; when the deadline passes it is aborted
        (which frees hf_xet's process-wide upload slots: a commit stuck on a dead server would
        otherwise stall every later upload of the process) and abandoned, and the call fails;
        what it uploaded is never added.
        """
        token, exp, cas_url = self._write_token.get(deadline)
        policy = batch_policy(self._compression, [d for _, d in items])
        started: list[Any] = []
        stagings: list[UploadStaging] = []  # per attempt: the objects' files in RAM (xet/uploads.py)

        def xet_upload() -> list[tuple[str, int]]:
            staging = UploadStaging()
            stagings.append(staging)
            # opened ahead (UploadCommits); the staged files are unlinked once the commit is over
            with staging, self._commits.take(token, exp, cas_url, self._write_token.margin, policy) as commit:
                started.append(commit)
                # One object at a time: its staging write overlaps the ingestion of the others.
                handles = [staging.start(commit, d) for _, d in items]
            out = []
            for h in handles:
                info = h.result().xet_info
                out.append((str(info.hash), int(info.file_size)))
            return out

        def timed_out() -> Exception:
            for commit in started:
                try:
                    commit.abort()
                except Exception:  # already finished or failed: nothing left to stop
                    log.debug("aborting an Xet upload commit failed", exc_info=True)
            for staging in stagings:  # the abandoned upload may never end: its files go now
                staging.close()
            return TimeoutError("the Xet upload timed out")

        def call(_t: httpx2.Timeout) -> list[tuple[str, int]]:
            if deadline is None:
                return xet_upload()
            return run_abandonable(xet_upload, deadline, timed_out)

        return self.retrying(call, "upload objects", deadline, bounded=False)

    # ---- reads ---------------------------------------------------------------------------
    def _xet_read_token(self, deadline: float | None = None) -> Token:
        """The store's one Xet read token: fetched once (one request however many loads ask at
        once), renewed shortly before it expires, waited for until ``deadline`` at most."""
        return self._read_token.get(deadline)

    def warm_reads(self) -> None:
        """Fetch the read token in the background, once: it overlaps the lookup's round trip
        instead of following it."""
        if self.direct_reads:  # no thread waits for it here: the loads that need it do
            self._read_token.start(deadline_in(self.request_timeout_secs))
            return
        with self._xet_lock:
            if self._warming or self._download_group is not None:
                return
            self._warming = True
        with contextlib.suppress(RuntimeError):  # closed: nothing to warm
            self._requests.submit(self._warm)

    def _warm(self) -> None:
        try:
            self._group(deadline_in(self.request_timeout_secs))
        except StoreError:  # the load that needs it tries again and reports the error
            log.debug("fetching the read token of %s failed", self.bucket_id, exc_info=True)
        finally:
            with self._xet_lock:
                self._warming = False

    def _reader_token(self, deadline: float | None, stale: str | None) -> Token:
        if stale is not None:
            self._read_token.forget(stale)
        return self._xet_read_token(deadline)

    def prefetch_reconstructions(self, files: Sequence[RemoteFile], *, background: bool = False,
                                 deadline: float | None = None) -> None:
        """Ask for the reconstruction of each file now, all at once, so that its load that
        follows is the fetch alone (xet_reads; cached briefly). ``background``: without making
        the caller wait for the threads that send them (a lookup's read-ahead). Each query ends
        by ``deadline`` (default: ``request_timeout_secs`` from now)."""
        if self.direct_reads:
            self._reader.prefetch([(f.xet_hash, f.size) for f in files if f.xet_hash], background=background,
                                  deadline=deadline)

    def plan_runs(self, files: Sequence[RemoteFile], deadline: float) -> list[list[int]]:
        """Every index of ``files`` once: runs of objects one fetch reads (xet_reads), the rest
        alone (all alone without direct reads)."""
        if not self.direct_reads or len(files) < 2:
            return [[i] for i in range(len(files))]
        hashes = [(f.xet_hash or "", f.size if f.xet_hash else 0) for f in files]
        return self._reader.plan_runs(hashes, deadline)

    def read_run(self, files: Sequence[tuple[RemoteFile, Any, Gate | None]], deadline: float) -> int:
        """Read a planned run with one fetch; how many, in order, were read whole (the others are
        left to :meth:`download_into`)."""
        return self._reader.read_run([(f.xet_hash or "", f.size, v, g) for f, v, g in files], deadline)

    def _group(self, deadline: float | None = None) -> Any:
        """One download group per store: one read token (seeded, so no stream asks for its own),
        renewed by hf_xet through the refresh URL, and one warm connection pool.

        Made once (under a lock: making one costs ~0.1 s of hf_xet client setup, and 64 loads
        arriving together would otherwise make 64), and ahead of the first load by warm_reads.
        """
        with self._xet_lock:
            group = self._download_group
        if group is not None:
            return group
        with self._group_lock:
            with self._xet_lock:
                if self._download_group is not None:
                    return self._download_group
            token, exp, cas_url = self._xet_read_token(deadline)
            from huggingface_hub.utils._xet import xet_headers_without_auth

            if self._holds_session:
                session = download_session(self.load_concurrency)
            else:  # held until close: the last client to close drops the process's session
                session = hold_download_session(self.load_concurrency)
                self._holds_session = True

            def call(_t: httpx2.Timeout) -> Any:
                return session.new_download_stream_group(
                    endpoint=cas_url, token=token, token_expiry_unix_secs=exp,
                    token_refresh_url=f"{self._base}/xet-read-token", token_refresh_headers=self._headers,
                    custom_headers=xet_headers_without_auth(self._headers),
                )

            group = self.retrying(call, "open the bucket's storage for reading")
            with self._xet_lock:
                self._download_group = group
            return group

    def reset_download_group(self) -> None:
        """After a failed read: the next one opens a new group with a freshly fetched token."""
        with self._xet_lock:
            self._download_group = None
        self._read_token.forget()

    def download_into(self, f: RemoteFile, view: memoryview, gate: Gate | None = None,
                      deadline: float | None = None) -> None:
        """Fill ``view`` (exactly ``f.size`` bytes long) with the object's bytes, from memory to
        memory: by plain HTTP with its cached reconstruction (xet_reads), or through hf_xet's
        stream when that reader meets something it does not know.

        With a ``gate``, every write goes through it, so a caller that stopped waiting (its
        deadline passed) never has its buffer written afterwards.
        """
        if view.nbytes != f.size:
            raise ValueError(f"buffer of {view.nbytes} bytes for an object of {f.size}")
        if f.size == 0:
            return
        if self.direct_reads and f.xet_hash:
            try:
                until = deadline if deadline is not None else deadline_in(self.request_timeout_secs)
                self._reader.read_into(f.xet_hash, view, gate, until)
                return
            except XetReadUnsupported as e:
                log.debug("reading %s through hf_xet: %s", f.path, e)
        self._stream_into(f, view, gate)

    def download_afresh(self, f: RemoteFile, view: memoryview) -> None:
        """Fill ``view`` through hf_xet, which asks the storage for a new reconstruction and reads
        on connections of its own (and decodes with its own decoder): the re-read of an object
        whose first read failed its checksum (stores/hub/versions.py)."""
        if not f.size:
            return
        if not self.direct_reads:  # the first read went through hf_xet too: a new group, new connections
            self.reset_download_group()
        self._stream_into(f, view, None)

    def _stream_into(self, f: RemoteFile, view: memoryview, gate: Gate | None) -> None:
        from hf_xet import XetFileInfo

        info = XetFileInfo(f.xet_hash, f.size)
        got = 0
        stream = self._group().download_unordered_stream(info)
        if gate is not None:
            gate.on_close = stream.cancel  # a caller giving up stops the transfer too
        for offset, data in stream:
            n = len(data)
            if offset < 0 or offset + n > f.size:
                raise StoreError(f"the storage returned bytes past the end of {f.path!r} ({f.size} bytes)")
            if gate is None:
                view[offset : offset + n] = data
            else:
                gate.write(view, offset, data)
            got += n
        if got != f.size:
            raise StoreError(f"the storage returned {got} of the {f.size} bytes of {f.path!r}")

    def prestart_threads(self) -> int:
        """Start the request threads now (a store opens), not in its first lookup's queries."""
        return self._requests.prestart()

    def close(self) -> None:
        with self._xet_lock:
            group, self._download_group = self._download_group, None
        self._write_token.forget()
        self._read_token.forget()
        self._commits.close()
        self._requests.shutdown(wait=False)  # idle threads end; a stuck one ends with its request
        self._reader.close()
        if group is not None:
            try:
                group.finish()
            except Exception:  # best-effort telemetry flush
                log.debug("closing the download group failed", exc_info=True)
        with self._group_lock:
            held, self._holds_session = self._holds_session, False
        if held:
            release_download_session(self.load_concurrency)


__all__ = ["HUB_BATCH_LIMIT", "HubBucketClient", "RemoteFile"]
