"""``S3Store``: the object-store protocol over AWS S3 and S3-compatible servers.

Client choice (measured with benchmarks/bench_s3.py, see docs/s3.md): obstore's *sync*
API called from a thread pool. Each call releases the GIL while the Rust client (reqwest/hyper,
object_store's SigV4, retries with jittered backoff) does the request, so a pool of
``s3_num_io_threads`` threads gives that many requests in flight at a fraction of boto3's CPU.
obstore's async API is avoided because it sometimes aborted the interpreter at exit here.
Reads of batches are the exception: obstore presigns them and libcurl runs them straight into
the caller's buffers (:mod:`kvbucket.stores.s3.direct`), at half the client CPU per byte.

Batches run their items concurrently on the pool and answer per item. A missing bucket is
detected once per store by a one-key listing, because S3 answers HEAD on a missing bucket with
the same bodiless 404 as a missing object.

Every verb has a total time budget (``s3_lookup_timeout_secs`` for ``head_many``,
``s3_load_timeout_secs`` for ``get_many``, ``s3_store_timeout_secs`` for ``put_many`` and
``delete_many``, ``s3_request_timeout_secs`` for each page of ``list``): libcurl batches stop
at it, obstore calls (which cannot be cancelled) are abandoned on the pool, and their items fail
with DeadlineExceededError. A load's first answer (the status and headers of any of its
requests) is its lookup part: with none within ``s3_lookup_timeout_secs`` the endpoint is hung
and the load ends there, so a load on the critical path costs a hung store the lookup budget,
not the load budget.
A circuit breaker (:mod:`kvbucket.stores.guard.breaker`) answers at once while the endpoint is down.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, cast

import obstore
import obstore.exceptions as obe

from kvbucket.chunks import as_view
from kvbucket.did_you_mean import with_hints
from kvbucket.errors import (
    AuthError,
    ConfigError,
    NotFoundError,
    SizeMismatchError,
    StoreError,
    TransientStoreError,
)
from kvbucket.secrets import redact
from kvbucket.stores.base import (
    Buffer,
    ItemResult,
    ObjectInfo,
    Revision,
    VersionedDelete,
    check_buffer_size,
    check_name,
    closed_during,
)
from kvbucket.stores.deadline import Abandoned, Gate, deadline_in, exceeded, left, wait_all
from kvbucket.stores.guard.breaker import CircuitBreaker, RemoteStore
from kvbucket.stores.s3 import versions as s3_versions
from kvbucket.stores.s3.client import build_client, claim_runtime, direct_reader
from kvbucket.stores.s3.config import S3Config, S3Target, resolve_target
from kvbucket.stores.s3.direct import CLOSED, EXPIRED, MISSING, UNANSWERED, Body, Outcome, WrongSize
from kvbucket.stores.s3.env import fill_from_env
from kvbucket.stores.s3.fallbacks import submit_all, within_budget
from kvbucket.stores.s3.kept import OVERLONG, overlong_error
from kvbucket.threads import DaemonThreadPool, in_daemon_thread, submit_current

_XML_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_STATUS = re.compile(r"status code: (\d{3})")
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeTooSkewed",
}
# obstore's retry loop (jittered exponential backoff, bounded by s3_max_retries and
# s3_retry_timeout_secs) covers 5xx, 429, timeouts and dropped connections; what reaches us
# with these statuses has exhausted it.
_THROTTLE_STATUS = {429}


class S3Store(RemoteStore):
    """Objects under ``s3://bucket/prefix``. Thread-safe; batch items run concurrently."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.target: S3Target = resolve_target(config)
        self.bucket = self.target.bucket
        self.prefix = self.target.prefix
        self.url = self.target.url
        self._secrets = (config.aws_access_key_id, config.aws_secret_access_key, config.aws_session_token)
        self._store = build_client(config, self.target)
        self._pool = DaemonThreadPool(config.s3_num_io_threads, "kvbucket-s3")  # never blocks exit
        self._pool_lock = threading.Lock()
        self._closed = False
        self._bucket_checked = False
        self._bucket_lock = threading.Lock()
        self._bucket_probe: Future[None] | None = None
        c = config
        self.breaker = CircuitBreaker(
            self.url, failures=c.s3_breaker_failures, cooldown_secs=c.s3_breaker_cooldown_secs,
            budgets={"head": c.s3_lookup_timeout_secs, "get": c.s3_load_timeout_secs,
                     "put": c.s3_store_timeout_secs, "delete": c.s3_store_timeout_secs},
        )
        # (verb, option, seconds) of each budget, for error messages.
        c = config
        self._budgets = {
            "head": ("a lookup", "s3_lookup_timeout_secs", c.s3_lookup_timeout_secs),
            "get": ("a load", "s3_load_timeout_secs", c.s3_load_timeout_secs),
            "put": ("a store", "s3_store_timeout_secs", c.s3_store_timeout_secs),
            "delete": ("a delete", "s3_store_timeout_secs", c.s3_store_timeout_secs),
            "list": ("a list page", "s3_request_timeout_secs", c.s3_request_timeout_secs),
        }
        self._put_concurrency = max(1, min(8, config.s3_num_io_threads))
        self._direct = direct_reader(config, self.target, self._store)

    @classmethod
    def from_config(cls, cfg: S3Config) -> S3Store:
        return cls(cfg)

    # ---- protocol -----------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        names = self._names([n for n, _ in items])
        views = [as_view(d) for _, d in items]
        deadline = deadline_in(self.config.s3_store_timeout_secs)
        self._ready(bool(names), deadline)
        return self._run(self._put_one, list(zip(names, views, strict=True)), deadline, "put")

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        names = self._names(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        deadline = deadline_in(self.config.s3_load_timeout_secs)
        # The first answer (any response's headers) is a lookup: a hung endpoint costs the lookup budget.
        answer_by = min(deadline, deadline_in(self.config.s3_lookup_timeout_secs))
        self._ready(False)  # the bucket probe only on a miss (_bucket_answers)
        bufs: Sequence[Buffer | None] = out if out is not None else [None] * len(names)
        args = list(zip(names, bufs, strict=True))
        if self._direct is None or not names or (urls := self._direct.sign(names)) is None:
            return self._bucket_answers(self._run(self._get_one, args, deadline, "get", answer_by), answer_by)
        fetched = self._direct.fetch(urls, bufs, deadline, answer_by)
        return self._bucket_answers(self._settle(args, fetched, self._get_one, deadline, "get"), answer_by)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._names(names)
        deadline = deadline_in(self.config.s3_lookup_timeout_secs)
        self._ready(False)  # the bucket probe only on a miss (_bucket_answers)
        args = [(n,) for n in names]
        if self._direct is None or not names or (urls := self._direct.sign(names, "HEAD")) is None:
            return self._bucket_answers(self._run(self._head_one, args, deadline, "head"), deadline)
        direct = self._settle(args, self._direct.head(urls, deadline), self._head_one, deadline, "head")
        return self._bucket_answers(direct, deadline)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        names = self._names(names)
        deadline = deadline_in(self.config.s3_store_timeout_secs)
        self._ready(bool(names), deadline)
        if not names:
            return []
        try:  # one DeleteObjects request per 1,000 keys
            self._bounded(lambda: obstore.delete(self._store, names), deadline)
            return [ItemResult(n) for n in names]
        except FutureTimeout:
            err = self._late("delete")
            return [ItemResult(n, error=err) for n in names]
        except Exception:  # retry one request per key to learn which ones failed
            return self._run(self._delete_one, [(n,) for n in names], deadline, "delete")

    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        """Whole objects and their ETags, through a new client (stores/s3/versions.py)."""
        return s3_versions.get_versions(self, self._names(names))

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        """HEAD, then ``DELETE`` with ``If-Match`` (stores/s3/versions.py)."""
        self._names([n for n, _ in items])
        return s3_versions.delete_versions(self, items)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        self._ready(True, first := deadline_in(self.config.s3_request_timeout_secs))  # page 1 shares it
        # obstore's prefixes match whole path segments; ours are plain string prefixes, so list the
        # enclosing "directory" and filter. No early stop on key order: SeaweedFS lists a tree
        # ("a/b" before "a%2Fx"), not in byte order as AWS does.
        parent = prefix.rsplit("/", 1)[0] if "/" in prefix else None
        try:
            pages = iter(obstore.list(self._store, parent, chunk_size=max(1, min(page_size, 1000))))
            while True:
                try:  # each page within s3_request_timeout_secs, the first with the probe
                    page = self._bounded(lambda: next(pages, None), first)
                except FutureTimeout:
                    raise self._late("list") from None
                if page is None:
                    break
                for meta in page:
                    name = str(meta["path"])
                    if name.startswith(prefix):
                        mtime = meta.get("last_modified")
                        yield ObjectInfo(name, int(meta["size"]), mtime.timestamp() if mtime else None,
                                         meta.get("e_tag"))
                first = deadline_in(self.config.s3_request_timeout_secs)  # the next page's own
        except StoreError:
            raise
        except Exception as e:
            raise self._error(e, "list", prefix or "/") from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.breaker.close()
            if self._direct is not None:  # first: its calls waiting for a slot end at once
                self._direct.close()
            with self._pool_lock:  # after _closed: _abandon_pool swaps no pool in past here
                pool = self._pool
            pool.shutdown(wait=True, cancel_futures=True)

    # ---- one item -----------------------------------------------------------------------
    def _put_one(self, name: str, view: memoryview) -> ItemResult:
        size = view.nbytes
        multipart = size > self.config.s3_multipart_threshold
        try:
            put = obstore.put(
                self._store,
                name,
                view,
                use_multipart=multipart,
                chunk_size=self.config.s3_multipart_part_size,
                max_concurrency=self._put_concurrency,
            )
        except Exception as e:
            return ItemResult(name, error=self._error(e, "put", name))
        return ItemResult(name, size=size, version=put.get("e_tag"))

    def _get_one(self, name: str, buf: Buffer | None, gate: Gate | None = None,
                 answered: threading.Event | None = None) -> ItemResult:
        try:
            result = obstore.get(self._store, name)
        except Exception as e:
            r = self._missing_or_error(e, "get", name)
            if answered is not None and not isinstance(r.error, TransientStoreError):
                answered.set()  # a 404 or a refusal: the server answers
            return r
        if answered is not None:
            answered.set()  # the status and headers arrived
        size = int(result.meta["size"])  # Content-Length, known before any body byte is read
        if buf is None:
            try:
                data = result.bytes()
            except Exception as e:
                return ItemResult(name, error=self._error(e, "get", name))
            if len(data) != size:
                return ItemResult(name, error=self._short(name, size, len(data)))
            return ItemResult(name, size=size, data=data)
        try:
            view = check_buffer_size(name, size, buf)  # before any byte is written
        except StoreError as e:
            return ItemResult(name, error=e)
        # Body frames go straight into the caller's buffer: one copy, no 2 MiB temporary. If the
        # transfer breaks midway the item is an error and the buffer's content is unspecified.
        got = 0
        try:
            for frame in result.stream(min_chunk_size=1):
                n = len(frame)
                if got + n > size:
                    return ItemResult(name, error=self._short(name, size, got + n))
                if gate is None:
                    view[got : got + n] = frame
                else:  # the caller may stop waiting: then this read must not touch its buffer
                    gate.write(view, got, frame)
                got += n
        except Abandoned:
            return ItemResult(name, error=self._late("get"))
        except Exception as e:
            return ItemResult(name, error=self._error(e, "get", name))
        if got != size:
            return ItemResult(name, error=self._short(name, size, got))
        return ItemResult(name, size=size, data=buf)

    def get_if_changed(self, name: str, tag: str | None) -> Revision:
        """One GET with ``If-None-Match: <ETag>``: a 304 costs no body (S3 and SeaweedFS)."""
        check_name(name)
        try:
            result = obstore.get(self._store, name, options={"if_none_match": tag} if tag else None)
            data = bytes(result.bytes())
        except obe.NotModifiedError:
            return Revision(tag)
        except Exception as e:
            r = self._missing_or_error(e, "get", name)
            if r.error is not None:
                raise r.error from None
            return Revision(None)
        etag = result.meta.get("e_tag")
        return Revision(etag or super().get_if_changed(name, None).tag, data)

    def _short(self, name: str, announced: int, arrived: int) -> SizeMismatchError:
        return SizeMismatchError(
            f"S3 object {self._where(name)} announced {announced} bytes but {arrived} arrived"
        )

    def _head_one(self, name: str) -> ItemResult:
        try:
            meta = obstore.head(self._store, name)
        except Exception as e:
            return self._missing_or_error(e, "head", name)
        return ItemResult(name, size=int(meta["size"]), version=meta.get("e_tag"))

    def _delete_one(self, name: str) -> ItemResult:
        try:
            obstore.delete(self._store, name)
        except Exception as e:
            return self._missing_or_error(e, "delete", name)
        return ItemResult(name)

    # ---- machinery ----------------------------------------------------------------------
    def _late(self, op: str) -> StoreError:
        what, option, secs = self._budgets[op]
        return exceeded(what, self.url, option, secs)

    def _bounded(self, fn: Callable[[], Any], deadline: float) -> Any:
        """``fn()`` on the pool; FutureTimeout when it has not finished by ``deadline`` (abandoned)."""
        try:
            fut = submit_current(lambda: self._pool, lambda: self._closed, fn)
        except RuntimeError:  # shut down by a concurrent close()
            if not self._closed:
                raise
            raise self._closed_during() from None
        try:
            return fut.result(timeout=left(deadline))
        except FutureTimeout:
            self._abandon_pool()
            raise

    def _run(
        self, fn: Callable[..., ItemResult], args: list[tuple[Any, ...]], deadline: float, op: str,
        answer_by: float | None = None,
    ) -> list[ItemResult]:
        """``fn(*a)`` for each item on the pool (obstore calls cannot be cancelled); items not done
        by ``deadline`` fail at once, and reads still running can no longer touch their buffers.
        With ``answer_by`` (reads), the call ends there if no request has had an answer yet."""
        if not args:
            return []
        if left(deadline) <= 0:
            err = self._late(op)
            return [ItemResult(a[0], error=err) for a in args]
        reads = op == "get"
        gates = [Gate() for _ in args] if reads else []
        answered = threading.Event() if reads and answer_by is not None else None
        extra = {} if answered is None else {"answered": answered}
        one_gate = [tuple(gates[i : i + 1]) for i in range(len(args))]
        futures = submit_all(lambda: self._pool, fn, args, one_gate,
                             lambda: self._closed, extra)  # None: refused, the store was closed
        sent = [f for f in futures if f is not None]
        late = self._late(op)
        if answered is not None and answer_by is not None and not wait_all(sent, answer_by) \
                and not answered.is_set():
            late = self._unanswered()  # not one answer within the lookup budget: hung
            self._abandon_pool()
        elif not wait_all(sent, deadline):
            self._abandon_pool()
        out = []
        for i, (a, f) in enumerate(zip(args, futures, strict=True)):
            if f is not None and f.done() and not f.cancelled():
                out.append(f.result())
                continue
            if reads:
                gates[i].close()
            if f is not None:
                f.cancel()
            out.append(ItemResult(a[0], error=self._closed_during() if self._closed else late))
        return out

    def _closed_during(self) -> StoreError:
        return closed_during(self.url)

    def _unanswered(self) -> StoreError:
        return exceeded("the first answer to a load", self.url, "s3_lookup_timeout_secs",
                        self.config.s3_lookup_timeout_secs)

    def _abandon_pool(self) -> None:
        """Workers stuck past a deadline stay with the old pool; later calls get fresh workers."""
        with self._pool_lock:
            if self._closed:
                return
            old = self._pool
            self._pool = DaemonThreadPool(self.config.s3_num_io_threads, "kvbucket-s3")
            old.hand_over(self._pool)  # other calls' queued work moves, never cancelled

    def _settle(
        self, args: list[tuple[Any, ...]], outcomes: Sequence[Outcome], fallback: Callable[..., ItemResult],
        deadline: float, op: str,
    ) -> list[ItemResult]:
        """One result per item: the direct outcome where it settles the item, else ``fallback``
        (obstore's call for one item, with its retries and error messages) on the pool."""
        results = [
            _settled(a[0], a[1] if len(a) > 1 else None, got) for a, got in zip(args, outcomes, strict=True)
        ]
        again = []
        for i, got in enumerate(outcomes):
            if got == EXPIRED:
                results[i] = ItemResult(args[i][0], error=self._late(op))
            elif got == CLOSED:  # closed while the call waited: nothing more is sent for it
                results[i] = ItemResult(args[i][0], error=self._closed_during())
            elif got == UNANSWERED:  # the endpoint is not answering: no fallback try
                results[i] = ItemResult(args[i][0], error=self._unanswered())
            elif got == OVERLONG:  # obstore would read the same answer and could not tell
                results[i] = ItemResult(args[i][0], error=overlong_error(
                    f"S3 {op} of {self._where(args[i][0])}", self.target.endpoint or "AWS"))
            elif results[i] is None:
                again.append(i)
        if again and self._direct is not None:  # obstore's GETs take the budget's slots too
            fallback = within_budget(fallback, self._direct.slots, deadline, lambda: self._late(op),
                                     self._closed_during)
        for i, r in zip(again, self._run(fallback, [args[i] for i in again], deadline, op), strict=True):
            results[i] = r
        return cast(list[ItemResult], results)

    def _ready(self, probe: bool = True, deadline: float | None = None, wait: bool = True) -> None:
        """Refuse work on a closed store; once per store, make sure the bucket exists.

        The probe runs on its own thread; a caller waits for it at most until its own deadline
        (a probe still running then leaves the real requests to answer, or to time out).
        ``wait=False`` only starts it. Lookups and loads do not send it at all unless an answer
        could mean a missing bucket (:meth:`_bucket_answers`): a fresh process's lookup + load
        of hits is then two round trips, its HEADs and its GETs, with no listing beside them.
        """
        if self._closed:
            raise StoreError(f"{self.url} is closed")
        claim_runtime()
        if self._bucket_checked or not probe:
            return
        with self._bucket_lock:
            if self._bucket_checked:
                return
            if self._bucket_probe is None:  # not on the pool: close() must not wait for it
                self._bucket_probe = in_daemon_thread(self._probe_bucket, "kvbucket-s3-probe")
            fut = self._bucket_probe
        if not wait:
            return
        try:
            fut.result(timeout=None if deadline is None else left(deadline))
        except (FutureTimeout, CancelledError):
            return

    def _bucket_answers(self, results: list[ItemResult], deadline: float) -> list[ItemResult]:
        """``results`` of a lookup or load before the bucket was checked: a miss there may be a
        missing bucket (S3 answers HEAD on one with the same bodiless 404), so the probe is sent
        (once per store) and awaited then, and raises NotFoundError for a missing bucket; hits
        prove the bucket and need no probe."""
        if not self._bucket_checked and any(
                (r.ok and r.size is None) or isinstance(r.error, NotFoundError) for r in results):
            self._ready(True, deadline)
        return results

    def _probe_bucket(self) -> None:
        try:
            next(iter(obstore.list(self._store, None, chunk_size=1)), None)
        except Exception as e:
            err = self._error(e, "list", "/")
            if isinstance(err, NotFoundError):
                with self._bucket_lock:
                    self._bucket_probe = None  # ask again next time
                raise err from None
            # Anything else (e.g. no s3:ListBucket permission) is left to the real requests.
        self._bucket_checked = True

    def _missing_or_error(self, e: BaseException, op: str, name: str) -> ItemResult:
        if isinstance(e, FileNotFoundError | obe.NotFoundError) and "NoSuchBucket" not in str(e):
            return ItemResult(name)
        return ItemResult(name, error=self._error(e, op, name))

    def _where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{name}"

    def _error(self, e: BaseException, op: str, name: str) -> StoreError:
        """A StoreError with a message the user can act on, never holding a secret."""
        text = str(e)
        first = redact(text.split("\n", 1)[0], *self._secrets)[:300]
        code_m = _XML_CODE.search(text)
        code = code_m.group(1) if code_m else ""
        status = _status(e)
        where = self._where(name) if name != "/" else self.url
        endpoint = self.target.endpoint or "AWS"
        if code == "NoSuchBucket" or (isinstance(e, FileNotFoundError | obe.NotFoundError) and op == "list"):
            return NotFoundError(
                f"bucket {self.bucket!r} does not exist at {endpoint}; create it first "
                "(kvbucket does not create buckets on its own)"
            )
        if isinstance(e, obe.PermissionDeniedError | obe.UnauthenticatedError) or status in (401, 403):
            hint = {
                "SignatureDoesNotMatch": "the secret access key is wrong",
                "InvalidAccessKeyId": "the access key id is unknown to the server",
                "AccessDenied": "the credentials lack permission for this bucket/key",
                "ExpiredToken": "the session token has expired",
            }.get(code, "the credentials were refused")
            return AuthError(
                f"S3 {op} of {where} refused ({code or status or 'denied'}): {hint}. Check "
                "aws_access_key_id/aws_secret_access_key (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                "and s3_region."
            )
        if (status is not None and (status >= 500 or status in _THROTTLE_STATUS)) or code in _TRANSIENT_CODES:
            return TransientStoreError(f"S3 {op} of {where} failed after retries ({code or status}): {first}")
        if "timed out" in text or "error sending request" in text or "connection" in text.lower():
            return TransientStoreError(f"S3 {op} of {where} could not reach {endpoint}: {first}")
        return StoreError(f"S3 {op} of {where} failed: {first}")


def _settled(name: str, buf: Buffer | None, got: Outcome) -> ItemResult | None:
    """The result a direct read or HEAD settled, or None when obstore should repeat it."""
    if isinstance(got, Body):
        return ItemResult(name, size=got.size, data=got.data, version=got.etag)  # a HEAD's: no data
    if got == MISSING:
        return ItemResult(name)
    if isinstance(got, WrongSize):
        try:
            check_buffer_size(name, got.size, buf)  # words the error; the buffer is untouched
        except StoreError as e:
            return ItemResult(name, error=e)
    return None


# ---- errors -----------------------------------------------------------------------------


def _status(e: BaseException) -> int | None:
    m = _STATUS.search(str(e))
    return int(m.group(1)) if m else None



# ---- openers ------------------------------------------------------------------------------


def open_s3_store(url: str, *, create: bool = False, **options: Any) -> S3Store:
    """Open ``s3://bucket[/prefix]``, filling unset options from the standard AWS env vars.

    ``create`` is accepted for symmetry with other openers and ignored: kvbucket never creates
    (or deletes) buckets, it only reports a missing one.

    ``AWS_ENDPOINT_URL`` (custom endpoint), ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` and ``AWS_ALLOW_HTTP``
    (or an ``http://`` endpoint) make ``kvbucket ls s3://b/p`` work with no config file.
    """
    opts: dict[str, Any] = {"s3_endpoint": url, **options}
    return S3Store(S3Config.parse(fill_from_env(opts, endpoint=True)))


# Keys of the non-MP ``extra_config`` that are not S3Config fields.
_EXTRA_ONLY_KEYS = {"save_chunk_meta"}


def store_from_remote_url(url: str, extra_config: dict[str, Any] | None, engine: Any = None) -> S3Store:
    """Build the store of a non-MP ``remote_url: s3://...`` with LMCache's ``extra_config`` keys.

    LMCache's S3 connector stores bare chunks: ``save_chunk_meta`` must be false and the engine's
    ``save_unfull_chunk`` must be false (a partial chunk would be read back as a full one). Keys
    not in ``extra_config`` are filled from the standard AWS env vars (see :func:`open_s3_store`).
    """
    extra = dict(extra_config or {})
    if extra.get("save_chunk_meta", False) is not False:
        raise ConfigError(
            "extra_config.save_chunk_meta must be false for an s3:// remote_url "
            "(objects hold bare chunks, as in LMCache)"
        )
    if engine is not None and getattr(engine, "save_unfull_chunk", False):
        raise ConfigError(
            "save_unfull_chunk must be false with an s3:// remote_url: only full chunks are "
            "stored remotely, so a partial chunk could be read back as a full one"
        )
    allowed = set(S3Config.model_fields) - {"s3_endpoint"}
    unknown = sorted(k for k in extra if k not in allowed and k not in _EXTRA_ONLY_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown extra_config key(s) for an s3:// remote_url: "
            f"{with_hints(unknown, allowed | _EXTRA_ONLY_KEYS)}; "
            f"known: {', '.join(sorted(allowed | _EXTRA_ONLY_KEYS))}"
        )
    opts = {k: v for k, v in extra.items() if k not in _EXTRA_ONLY_KEYS}
    if "s3_endpoint" in extra:
        raise ConfigError("set the bucket in remote_url, not extra_config.s3_endpoint")
    timeout = getattr(engine, "blocking_timeout_secs", None) if engine is not None else None
    if timeout and "s3_retry_timeout_secs" not in opts:
        opts["s3_retry_timeout_secs"] = float(timeout)
    if not url.startswith("s3://"):
        raise ConfigError(f"remote_url {url!r} is not an s3:// URL")
    # Unset options come from the standard AWS env vars, as in the CLI; AWS_ENDPOINT_URL only
    # for a plain s3://bucket, so a remote_url that names its host (AWS, S3 Express, CoreWeave)
    # is used as written.
    plain_bucket = "." not in url[len("s3://") :].partition("/")[0]
    return S3Store(S3Config.parse(fill_from_env({"s3_endpoint": url, **opts}, endpoint=plain_bucket)))


__all__ = ["S3Config", "S3Store", "S3Target", "open_s3_store", "store_from_remote_url"]
