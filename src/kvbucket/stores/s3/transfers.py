"""One libcurl transfer of a direct S3 read (stores/s3/direct.py): what its callbacks write where,
and the outcome it comes to."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbucket.stores.base import Scatter

_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
MISSING = "missing"  # 404 NoSuchKey: the object is not there
RETRY = "retry"  # let obstore do this one
EXPIRED = "expired"  # the batch's deadline passed before this item finished
UNANSWERED = "unanswered"  # ``answer_by`` passed without an answer to any request of the batch
CLOSED = "closed"  # the reader was closed before this item finished: nothing more is sent for it
_ERROR_BODY_MAX = 64 * 1024
#: A sealed payload's checksum is fed this many bytes at a time (from the caller's buffer, still
#: in cache): one GIL-releasing call per 256 KiB instead of a call per 16 KiB frame.
HASH_STEP = 256 * 1024


@dataclass(frozen=True)
class Body:
    """A body received whole: ``data`` is the caller's buffer or a new bytearray."""

    size: int
    data: Any
    etag: str | None = None


@dataclass(frozen=True)
class WrongSize:
    """The object has ``size`` bytes but the caller's buffer another size. One GET leaves the
    buffer untouched; in ranges, those answered before the size changed (the object replaced
    during the load) may have written theirs: its contents are then undefined (docs/s3.md)."""

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
    # What kept.ConnectionWatch learns of this transfer's connection: the socket libcurl opened
    # for it (until its first request), its local port, whether a later request took it after a
    # clean check (``handed``) or found the excess of this answer waiting on it (``excess``).
    fd: int = -1
    port: int = -1
    handed: bool = False
    excess: bool = False
    announced: int = -1
    pos: int = 0
    data: Any = None
    wrong_size: bool = False
    error_body: bytearray = field(default_factory=bytearray)
    etag: str | None = None  # a HEAD's (the version eviction deletes) or a range's (its version)
    # Into a sealed object's payload once the header has landed: (payload view, header size,
    # hasher, the Scatter, the payload's address); see _fast_path.
    fast: tuple[memoryview, int, Any, Scatter, int] | None = None
    #: A ranged GET of bytes [a, b) of an object of ``whole`` bytes (``view`` is those bytes of
    #: the caller's buffer): only a 206 whose Content-Range says ``a-(b-1)/whole`` is written.
    rng: tuple[int, int] | None = None
    base: int = 0  # the range's first byte (where pos 0 lands in ``view``)
    whole: int = -1
    total: int = -1  # the object's size per Content-Range

    def header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):  # a new response (after 100-continue or a redirect)
            parts = line.split(None, 2)
            self.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            self.announced = -1
            self.closing = line.startswith(b"HTTP/1.0")  # 1.0 keeps a connection only if it says so
        elif line[:15].lower() == b"content-length:":
            value = line[15:].strip()
            self.announced = int(value) if value.isdigit() else -1
        elif (self.head or self.rng is not None) and line[:5].lower() == b"etag:":
            self.etag = line[5:].strip().decode("latin-1") or None
        elif self.rng is not None and line[:14].lower() == b"content-range:":
            self.total = content_range(line[14:], self.rng)
        elif line[:11].lower() == b"connection:":
            value = line[11:].lower()
            self.closing = b"close" in value or (self.closing and b"keep-alive" not in value)
        elif line in (b"\r\n", b"\n"):
            self.headed = True

    def opened(self, fd: int, _purpose: int) -> int:
        """libcurl's socket-options callback: ``fd`` is a new connection's socket for this transfer."""
        self.fd = fd
        return 0  # CURL_SOCKOPT_OK

    def write(self, chunk: bytes) -> int | None:
        """libcurl's write callback; returning 0 aborts the transfer (CURLE_WRITE_ERROR)."""
        fast = self.fast
        if fast is not None:  # the hot path: a frame of a sealed payload, in order (16 per 256 KiB)
            pos = self.pos
            end = pos + len(chunk)
            if end > self.announced:
                return 0
            payload, off, hasher, dst, base = fast
            at = self.base  # where this transfer's bytes start in the object (a range's first byte)
            # in bounds: at + end <= at + announced, which is the range's end or the payload's
            _memmove(base + at + pos - off, chunk, end - pos)
            self.pos = end
            hashed = dst.hashed  # the hash trails the bytes by < HASH_STEP (never claims more)
            if at + end - hashed >= HASH_STEP or end == self.announced:
                hasher.update(payload[hashed - off : at + end - off])  # in cache; releases the GIL
                dst.hashed = at + end
            return None
        if self.status != (200 if self.rng is None else 206):
            if 200 <= self.status < 300:  # e.g. a range answered 200 (Range ignored: every byte of
                return 0  # the object, once per range): stop now, the object is read whole once
            if len(self.error_body) < _ERROR_BODY_MAX:
                self.error_body += chunk[: _ERROR_BODY_MAX - len(self.error_body)]
            return None
        if self.data is None:  # first body byte: check the announced size before writing any
            if self.announced < 0:
                return 0
            if self.rng is not None:  # a range: the object's size and the range's length, exactly
                if self.total != self.whole:  # another object, or another range
                    self.wrong_size = self.total >= 0
                    return 0
                if self.announced != self.rng[1] - self.rng[0] or self.view is None:
                    return 0
                self.data = self.view
            elif self.view is None:
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
        at = self.base
        self.view[at + self.pos : at + end] = chunk
        self.pos = end
        if type(self.view) is Scatter:
            self.fast = _fast_path(self.view, at + end)
        return None

    def outcome(self, curl_ok: bool, original: Any) -> Outcome:
        if self.rng is not None:  # one range of an object: joined by split.join_ranges
            if self.wrong_size:
                return WrongSize(self.total)
            if self.status == 404 and curl_ok and b"<Code>NoSuchKey</Code>" in self.error_body:
                return MISSING
            ok = curl_ok and self.status == 206 and self.total == self.whole
            whole = ok and self.pos == self.announced == self.rng[1] - self.rng[0]
            return Body(self.pos, None, self.etag) if whole else RETRY  # etag: its version (join_ranges)
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


def content_range(value: bytes, rng: tuple[int, int]) -> int:
    """The object's size from a Content-Range value ``bytes a-b/total``, or -1 when the range is
    not exactly ``rng`` (or the size is unknown)."""
    unit, _, rest = value.strip().partition(b" ")
    span, _, total = rest.partition(b"/")
    first, _, last = span.partition(b"-")
    if unit.lower() != b"bytes" or not (first.isdigit() and last.isdigit() and total.isdigit()):
        return -1
    return int(total) if (int(first), int(last) + 1) == rng else -1


class Slots:
    """The transfer budget shared by every call on a reader (``s3_num_io_threads``): a counting
    semaphore that :meth:`close` ends. Why not ``threading.BoundedSemaphore``: a call waiting for
    a slot when the store is closed would wait to its deadline and could then send a request;
    here every waiter wakes at once with False (and no later acquire succeeds)."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._n = n
        self._free = n
        self.closed = False

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._cond:
            if not blocking:
                ok = not self.closed and self._free > 0
            else:
                ok = self._cond.wait_for(lambda: self.closed or self._free > 0, timeout) and not self.closed
            if ok:
                self._free -= 1
            return ok

    def release(self) -> None:
        with self._cond:
            if self._free >= self._n:
                raise ValueError("a transfer slot was released more times than it was taken")
            self._free += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


__all__ = ["CLOSED", "EXPIRED", "HASH_STEP", "MISSING", "RETRY", "UNANSWERED", "Body", "Outcome", "Slots",
           "WrongSize", "content_range"]
