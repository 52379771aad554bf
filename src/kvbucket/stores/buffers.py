"""Read destinations and write sources of the protocol: :class:`Scatter` (a read into several
buffers), :class:`Gather` (a write of several buffers) and the length check of caller buffers.

Split from :mod:`kvbucket.stores.base` (which re-exports them) to keep the protocol file short.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from kvbucket.chunks import as_view
from kvbucket.errors import InvalidKeyError, SizeMismatchError
from kvbucket.stores.deadline import Abandoned

# Anything exposing the buffer protocol (bytes, bytearray, memoryview, numpy arrays) and contiguous
# CPU torch tensors: read through :func:`kvbucket.chunks.as_view`.
Buffer: TypeAlias = Any


class Scatter:
    """A read destination made of several writable buffers filled in order (a scatter read).

    The sealing layer (:mod:`kvbucket.stores.guard.sealed`) reads an object's envelope header into a
    small buffer and its payload straight into the caller's buffer with one read: every store
    accepts a ``Scatter`` wherever ``get_many`` accepts a buffer. Stores write into it exactly as
    into a flat view (``dst[a:b] = data``; :meth:`views_from` for ``readv``); ``data`` of the
    result is the ``Scatter`` itself.

    A redirectable Scatter (:meth:`allow_redirect`, a read-ahead's) keeps the served-bytes
    invariant (docs/integrity.md, "Every byte served is the byte verified") with two steps taken
    by the layer that reads through it: :meth:`close` when the store's read is over (no write and
    no redirect after it: the bytes are where :attr:`parts` say, and every in-place stage,
    checksum or decryption, works there) and :meth:`settle` when those stages are done. A
    redirect is accepted only before ``close``, so no stage ever runs on bytes that then move.
    """

    __slots__ = ("_closed", "_lock", "_settled", "_spans", "_written", "hash_from", "hashed", "hasher",
                 "nbytes", "on_wrap", "parts", "rewritten")
    readonly = False

    def __init__(self, *parts: Buffer, hasher: Any = None, hash_from: int = 0) -> None:
        views = []
        for p in parts:
            # as_view: bytes-likes, numpy arrays and CPU torch tensors of any dtype and shape (which
            # memoryview() refuses) as flat bytes; a non-contiguous buffer is its ValueError.
            v = as_view(p)
            if v.readonly:
                raise InvalidKeyError("a scatter-read part is read-only")
            views.append(v)
        self.parts: tuple[memoryview, ...] = tuple(views)
        spans, total = [], 0
        for v in views:
            spans.append((total, total + v.nbytes, v))
            total += v.nbytes
        self._spans: tuple[tuple[int, int, memoryview], ...] = tuple(spans)
        self.nbytes = total
        # Optional streaming hash (``update(view)``) of bytes ``hash_from..``, fed as bytes land
        # in order; ``hashed`` is how far it got (out-of-order writes are hashed by the caller).
        self.hasher = hasher
        self.hash_from = hash_from
        self.hashed = hash_from
        self.rewritten = False  # bytes already hashed were written again (a retried transfer)
        # A layer that reads into these parts through a Scatter of its own (the sealing layer:
        # header + these parts) calls this with that Scatter (a read-ahead redirects through it).
        self.on_wrap: Callable[[Scatter], Any] | None = None
        self._lock: threading.Lock | None = None  # set by allow_redirect(): writes then lock
        self._written: list[tuple[int, int]] = []
        self._closed = False  # close(): the read is over (redirectable Scatters refuse writes then)
        self._settled: threading.Event | None = None  # set by settle() (made by allow_redirect)

    def __len__(self) -> int:
        return self.nbytes

    def landed(self, start: int, stop: int) -> None:
        """Bytes ``start..stop`` were written: feed the hash when they continue it."""
        if self.hasher is None or self.rewritten:
            return
        if start < self.hashed and self.hashed > self.hash_from and stop > self.hash_from:
            self.rewritten = True  # the hash holds bytes of an earlier attempt: it is void
            return
        if start > self.hashed or stop <= self.hashed:
            return
        for view in self.views_range(self.hashed, stop):
            self.hasher.update(view)
        self.hashed = stop

    def views_range(self, start: int, stop: int) -> list[memoryview]:
        """The views covering bytes ``start..stop``."""
        out = []
        for pstart, pend, part in self._spans:
            lo, hi = max(start, pstart), min(stop, pend)
            if lo < hi:
                out.append(part[lo - pstart : hi - pstart])
        return out

    def allow_redirect(self) -> None:
        """Let :meth:`redirect` move a part while writes land (call before any write). Only
        for writers that write through ``dst[a:b] = data`` or :meth:`fill` (both under the lock,
        recorded), never :meth:`views_from`, nor into the parts' memory any other way: such a
        writer's store sets no ``redirectable_reads``)."""
        if self._lock is None:
            self._lock = threading.Lock()
            self._settled = threading.Event()

    @property
    def redirectable(self) -> bool:
        return self._lock is not None

    def close(self) -> tuple[memoryview, ...]:
        """The read through this Scatter is over: refuse every later write (an abandoned transfer's)
        and redirect; returns the parts, where the bytes now stay. Call before any stage that
        reads or transforms the bytes in place (checksum, decryption). Idempotent."""
        lock = self._lock
        if lock is None:
            self._closed = True
            return self.parts
        with lock:
            self._closed = True
            return self.parts

    def settle(self) -> None:
        """Every stage on these bytes is done (they are final, or refused): a reader whose buffer
        they are in may take it back (:meth:`wait_settled`). Implies :meth:`close`. Idempotent."""
        self.close()
        if self._settled is not None:
            self._settled.set()

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`settle` (True at once for a Scatter that does not allow redirects)."""
        return True if self._settled is None else self._settled.wait(timeout)

    def redirect(self, index: int, view: memoryview) -> int | None:
        """From now on, write part ``index``'s bytes into ``view`` (same size) instead; the
        bytes already written there are copied over first. Why: a read-ahead still on its way
        when its load arrives lands in the load's buffer, with no copy afterwards. Returns the
        bytes copied, or None when the Scatter is closed (the read is over: the bytes stay where
        they are, and any stage that works on them in place works there)."""
        lock = self._lock
        if lock is None:
            raise RuntimeError("this Scatter does not allow redirects (allow_redirect before writing)")
        with lock:
            if self._closed:
                return None
            old = self.parts[index]
            if view.nbytes != old.nbytes:
                raise ValueError(f"a redirect needs {old.nbytes} bytes, got {view.nbytes}")
            pstart, copied = self._spans[index][0], 0
            for a, b in self._written:
                lo, hi = max(a, pstart), min(b, pstart + old.nbytes)
                if lo < hi:
                    view[lo - pstart : hi - pstart] = old[lo - pstart : hi - pstart]
                    copied += hi - lo
            parts = list(self.parts)
            parts[index] = view
            self.parts = tuple(parts)
            spans = list(self._spans)
            spans[index] = (pstart, pstart + view.nbytes, view)
            self._spans = tuple(spans)
        return copied

    def __setitem__(self, key: slice, data: Buffer) -> None:
        lock = self._lock
        if lock is None:
            self._set(key, data)
            return
        with lock:
            if self._closed:  # an abandoned transfer: its bytes must not land where the read's did
                raise Abandoned("this read is over: a late write into its destination was refused")
            self._set(key, data)
            self._written.append(key.indices(self.nbytes)[:2])

    def fill(self, start: int, limit: int, write: Callable[[memoryview], int]) -> int:
        """Let ``write`` produce bytes in place from ``start``: it gets the writable view of the
        part holding ``start`` (up to ``limit`` or the part's end), fills a prefix of it and
        returns that prefix's length, which is returned. For decoders that write their output
        straight into the destination (stores/hub/xet/decode.py) instead of building it elsewhere
        and copying it: like an item write, it runs under the redirect lock, is recorded for a
        redirect's copy and feeds the hash. 0 when no part holds ``start`` (``write`` not called)."""
        lock = self._lock
        if lock is None:
            return self._fill(start, limit, write)
        with lock:
            if self._closed:  # as for an item write: an abandoned transfer's bytes must not land
                raise Abandoned("this read is over: a late write into its destination was refused")
            n = self._fill(start, limit, write)
            self._written.append((start, start + n))
        return n

    def _fill(self, start: int, limit: int, write: Callable[[memoryview], int]) -> int:
        for pstart, pend, part in self._spans:
            if pstart <= start < pend:
                n = write(part[start - pstart : min(limit, pend) - pstart])
                if n:
                    self.landed(start, start + n)
                return n
        return 0

    def _set(self, key: slice, data: Buffer) -> None:
        # The hot path (a network frame or file read inside one part, continuing the hash): one
        # slice copy, then the hash fed from the source while it is still in cache. Called once
        # per received frame, so it is kept to a few operations.
        start, stop = key.start, key.stop
        if key.step is None and type(start) is int and type(stop) is int and 0 <= start <= stop:
            for pstart, pend, part in self._spans:
                if pstart <= start and stop <= pend:
                    try:
                        part[start - pstart : stop - pstart] = data
                    except (ValueError, TypeError):
                        break  # another length or format: the general path says why (or casts)
                    if start == self.hashed and self.hasher is not None and not self.rewritten:
                        self.hasher.update(data)
                        self.hashed = stop
                    else:
                        self.landed(start, stop)
                    return
        self._set_general(key, data)

    def _set_general(self, key: slice, data: Buffer) -> None:
        start, stop, step = key.indices(self.nbytes)
        src = memoryview(data)
        src = src.cast("B") if src.format != "B" or src.ndim != 1 else src
        if step != 1 or stop - start != src.nbytes:
            raise ValueError("a scatter write needs a contiguous slice of the data's length")
        for pstart, pend, part in self._spans:
            lo, hi = max(start, pstart), min(stop, pend)
            if lo < hi:
                part[lo - pstart : hi - pstart] = src[lo - start : hi - start]
        self.landed(start, stop)

    def views_from(self, offset: int) -> list[memoryview]:
        """The writable views covering bytes ``offset..`` (for ``os.readv``)."""
        if offset == 0:
            return [p for p in self.parts if p.nbytes]
        out = []
        for pstart, pend, part in self._spans:
            if pend > offset and part.nbytes:
                out.append(part[max(0, offset - pstart) :])
        return out


class Gather:
    """A write source made of several buffers, stored as their concatenation (a gather write).

    The sealing layer passes the envelope header and a caller's regions (e.g. the strided pages
    of an engine's host KV pool) as one ``Gather`` to stores whose ``gathers`` attribute is true
    (a directory: one ``writev``, no copy into a staging buffer); other stores get the joined
    bytes (:meth:`join`).
    """

    __slots__ = ("_head", "_parts", "nbytes")

    def __init__(self, *parts: Buffer) -> None:
        views = []
        for p in parts:
            v = p if type(p) is memoryview else memoryview(p)
            if not v.c_contiguous:
                raise ValueError("a gather-write part is not a contiguous buffer")
            views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
        self._parts: tuple[memoryview, ...] = tuple(views)
        self._head: tuple[int, Callable[[tuple[memoryview, ...]], bytes]] | None = None
        self.nbytes = sum(v.nbytes for v in views)

    @classmethod
    def headed(cls, size: int, make: Callable[[tuple[memoryview, ...]], bytes], *parts: Buffer) -> Gather:
        """``parts`` behind a ``size``-byte head that ``make(parts)`` returns when first needed.

        Why: a sealed object's header holds its payload's checksum. Made in the seal, the
        hashing of a whole batch (13-16 ms per 128 MiB) ran before a Hub bucket's upload could
        start; made when the store first reads the parts, each object is hashed just before it
        is handed to the uploader, while the objects before it are being uploaded.
        """
        g = cls(*parts)
        g._head = (size, make)
        g.nbytes += size
        return g

    @property
    def parts(self) -> tuple[memoryview, ...]:
        if self._head is not None:
            size, make = self._head
            head = make(self._parts)
            if len(head) != size:
                raise ValueError(f"a gather's head is {len(head)} bytes, {size} were announced")
            self._parts, self._head = (memoryview(head), *self._parts), None
        return self._parts

    def __len__(self) -> int:
        return self.nbytes

    def sample(self, nbytes: int) -> memoryview:
        """Up to ``nbytes`` from the middle of the largest part, without making the head (what
        a guess at the payload's compressibility reads: xet_compression)."""
        part = max(self._parts, key=lambda v: v.nbytes, default=memoryview(b""))
        start = max(0, (part.nbytes - nbytes) // 2)
        return part[start : start + nbytes]

    def views_from(self, offset: int) -> list[memoryview]:
        """The views covering bytes ``offset..`` (for ``os.writev`` after a short write)."""
        out, start = [], 0
        for part in self.parts:
            end = start + part.nbytes
            if end > offset and part.nbytes:
                out.append(part[max(0, offset - start) :])
            start = end
        return out

    def join(self, reuse: bytearray | None = None) -> bytearray:
        """The parts' bytes in one buffer (one copy, made by numpy without the GIL: a slice
        assignment holds it for every byte, and this is a store's copy of what it uploads):
        ``reuse`` when it has the right size (a fresh ``bytearray(n)`` zeroes its pages holding
        the GIL), else a new one."""
        import numpy as np

        out = reuse if reuse is not None and len(reuse) == self.nbytes else bytearray(self.nbytes)
        dst = np.frombuffer(out, np.uint8)
        pos = 0
        for part in self.parts:
            np.copyto(dst[pos : pos + part.nbytes], np.frombuffer(part, np.uint8))
            pos += part.nbytes
        del dst  # no export left on the bytearray
        return out


def check_buffer_size(name: str, size: int, buffer: Buffer) -> Any:
    """Return a writable byte view of ``buffer`` when it holds exactly ``size`` bytes.

    Reads into caller buffers must never write past (or short of) the buffer, so a size
    difference is an error for that item, and the buffer is left untouched. A :class:`Scatter`
    is returned as is (it is already a flat, writable destination).
    """
    if isinstance(buffer, Scatter):
        if buffer.nbytes != size:
            raise SizeMismatchError(
                f"object {name!r} has {size} bytes but the buffer given for it has {buffer.nbytes}"
            )
        return buffer
    try:  # numpy, CPU torch tensors (memoryview() refuses them) and any C-contiguous buffer
        view = as_view(buffer)
    except (TypeError, ValueError) as e:  # not contiguous, a GPU tensor, not a buffer: this item's error
        raise InvalidKeyError(f"the buffer given for {name!r} cannot be read into: {e}") from None
    if view.readonly:
        raise InvalidKeyError(f"the buffer given for {name!r} is read-only")
    if view.nbytes != size:
        raise SizeMismatchError(
            f"object {name!r} has {size} bytes but the buffer given for it has {view.nbytes}"
        )
    return view


def put_view(name: str, data: Any) -> memoryview | Gather:
    """The bytes a put hands over, as a flat byte view (a :class:`Gather` as it is); what a put
    cannot take is a TypeError or ValueError naming the object."""
    if isinstance(data, Gather):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        kind = type(data).__name__
        raise TypeError(f"the data for {name!r} is a {kind}, not a bytes-like object") from None
    if not view.c_contiguous:
        raise ValueError(f"the data for {name!r} is not a contiguous buffer; pass a contiguous copy")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


__all__ = ["Buffer", "Gather", "Scatter", "check_buffer_size", "put_view"]
