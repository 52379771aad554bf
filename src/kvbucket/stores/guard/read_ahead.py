"""Read-ahead: a lookup hit starts the load, so the load finds the bytes there or on their way.

An engine asks "is this prefix stored?" and, on a hit, asks for its bytes a little later (LMCache's
``lookup_and_lock`` then ``load``, SGLang's ``batch_exists`` then ``batch_get_v1``, vLLM's lookup
then load, the backend API's ``contains`` then ``get``). At wide-area latency each of those is at
least one round trip, and the first one is already enough to know what the second will fetch.
:class:`PrefetchStore` wraps the store a path loads from; the path calls :func:`read_ahead` with
its hits and sizes, which starts one batched ``get_many`` into buffers held here; the path's
``get_many`` then takes the bytes (waiting for a read still on its way, never sending another
request for it) and sends only the rest to the store.

Why it wraps the *verified* store (the sealing layer, :mod:`kvbucket.stores.guard.sealed`): read-ahead
bytes go through exactly the verification of a normal load, during the read-ahead; an object
that fails it is refused there (counted, removed as usual) and the load finds nothing to take.

Bounds: the bytes held (in flight or landed) never exceed ``max_bytes`` (a read-ahead that would
pass it is not started); an entry no load took within ``ttl_secs`` is dropped; a write or delete
of a name drops its entry before and after it. So a lookup never followed by a load costs at
most ``max_bytes``. One budget: a load waits for its read-ahead until that read's deadline.

Why buffers are recycled and copies run on two threads: at 0 ms a lookup + load with read-ahead
is the load plus moving the bytes from the buffer to the caller's. A fresh buffer per entry paid
its first-touch page faults on every batch (128 MiB of them for 16 x 8 MiB: the read-ahead's
fetch took up to twice the load's), so a buffer a load copied out of goes to a free pool, kept
*inside* ``max_bytes`` (held + pooled never pass it; pooled buffers are freed first when a
read-ahead needs the room, and all of them once no read-ahead came for ``ttl_secs``). The copy
is ``numpy.copyto``, which releases the GIL, split between the loading thread and one helper.

Why a load redirects a read-ahead still on its way: at 0 ms the load arrives a few milliseconds
after the lookup, before most bytes landed, and copying 128 MiB out of the buffer afterwards cost
a lookup + load ~15-25% against a load alone. When the store writes through the destination
(``redirectable_reads``: a Hub bucket), the read-ahead reads through a :class:`Scatter` over its
buffer that the sealing layer wraps; the load moves it to its own buffer (:meth:`Scatter.redirect`
copies what had landed) until the read is over, so the rest lands there (:meth:`_serve`: the gate).

Counters (:mod:`kvbucket.metrics`): ``kvbucket_read_ahead_bytes{store, outcome}`` (``prefetched``,
``used``, ``wasted``), gauges ``kvbucket_read_ahead_held_bytes``/``_pooled_bytes`` (<= ``max_bytes``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait
from typing import Any

import numpy as np

from kvbucket.errors import DeadlineExceededError, StoreError, TransientStoreError
from kvbucket.stores.base import (
    Buffer,
    ItemResult,
    ObjectInfo,
    ObjectStore,
    Scatter,
    VersionedDelete,
    check_buffer_size,
)
from kvbucket.stores.guard.read_ahead_config import ReadAheadConfig, ReadAheadSettings
from kvbucket.stores.guard.read_ahead_metrics import (
    READ_AHEAD_BYTES,
    READ_AHEAD_HELD,
    READ_AHEAD_POOLED,
    read_ahead_series,
)
from kvbucket.threads import DaemonThreadPool

HELD, TAKEN, DROPPED = "held", "taken", "dropped"  # in the table / a load owns it / forgotten


#: How long past a read-ahead's deadline a load still waits for its batch: the verifying store
#: returns at the deadline (+ its own grace to collect abandoned fetches), then checks and
#: decrypts what landed (CPU work) before the batch is done.
READ_AHEAD_GRACE_SECS = 0.5

#: Below this many bytes a load copies alone (a helper thread's hand-off costs more than it saves).
PARALLEL_COPY_BYTES = 4 << 20


class _Entry:
    __slots__ = ("born", "buf", "done", "home", "landing", "lock", "name", "redirected", "result", "size",
                 "state", "writer")

    def __init__(self, name: str, size: int, done: threading.Event, born: float, buf: np.ndarray) -> None:
        self.name = name
        self.size = size
        self.buf: np.ndarray | None = buf
        self.done = done  # set when the batch's get_many returned
        self.result: ItemResult | None = None
        self.state = HELD
        self.born = born
        # When the store is redirectable: what the read-ahead reads into (a Scatter over buf), buf's
        # view in it, and the Scatter the bytes are written through with buf's part in it (the
        # landing, or the sealing layer's Scatter around it). ``lock`` orders redirects and wraps.
        self.landing: Scatter | None = None
        self.home: memoryview | None = None
        self.writer: tuple[Scatter, int] | None = None
        self.lock = threading.Lock()
        self.redirected: memoryview | None = None  # the load's buffer the bytes now land in


class PrefetchStore(ObjectStore):
    """``inner`` with a bounded read-ahead buffer in front of its ``get_many`` (module docstring)."""

    prefetches = True

    def __init__(self, inner: ObjectStore, settings: ReadAheadSettings, *, label: str = "remote",
                 wait_secs: float = 60.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.settings = settings
        self.label = label
        self.wait_secs = wait_secs  # longest wait for a read-ahead on its way, in a store without a budget
        # A remote store's load budget (its breaker's, through sealing layers; not imported here:
        # kvbucket.metrics imports this module) is the read-ahead's and the load's.
        budgets = getattr(getattr(inner, "breaker", None), "budgets", None)
        self._budget: float | None = budgets.get("get") if isinstance(budgets, dict) else None
        self.redirects = bool(getattr(inner, "redirectable_reads", False))
        self.redirected = 0  # loads that took a read-ahead's destination on its way (tests)
        self.redirect_copied = 0  # bytes that had landed before (copied by the redirects)
        self._entries: dict[str, _Entry] = {}
        self._held = 0
        self._free: dict[int, list[np.ndarray]] = {}  # buffers loads copied out of, by size
        self._pooled = 0  # their bytes: held + pooled never pass max_bytes
        self._last_prefetch = 0.0
        self.allocated = 0  # read-ahead buffers made new (tests: reuse counts)
        self.reused = 0  # read-ahead buffers taken from the free pool
        self._lock = threading.Lock()
        self._pool = DaemonThreadPool(4, "kvbucket-read-ahead")
        self._copier = DaemonThreadPool(1, "kvbucket-read-ahead-copy")
        self._sweeper: threading.Timer | None = None
        self._closed = False
        (self._prefetched, self._used, self._wasted, self._held_gauge,
         self._pooled_gauge) = read_ahead_series(label, settings.metrics)
        self._held_shown = self._pooled_shown = 0  # this store's share of the gauges (_publish)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"PrefetchStore({self.inner!r}, max_bytes={self.settings.max_bytes})"

    @property
    def held_bytes(self) -> int:
        """Bytes reserved by read-aheads in flight or landed and not taken (never above the bound)."""
        return self._held

    @property
    def pooled_bytes(self) -> int:
        """Bytes of free buffers kept for the next read-aheads (held + pooled never pass the bound)."""
        return self._pooled

    def _publish(self) -> None:
        """Move the held and pooled gauges by this store's change since it last did (lock held):
        stores of one label (every tier's, every process-wide adapter's) add up, never overwrite."""
        self._held_gauge.inc(self._held - self._held_shown)
        self._pooled_gauge.inc(self._pooled - self._pooled_shown)
        self._held_shown, self._pooled_shown = self._held, self._pooled

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every read-ahead held has landed (or failed); False if ``timeout`` passed."""
        end = time.monotonic() + timeout
        with self._lock:
            pending = [e.done for e in self._entries.values()]
        return all(d.wait(max(0.0, end - time.monotonic())) for d in pending)

    # ---- read-ahead ---------------------------------------------------------------------
    def prefetch(self, names: Sequence[str], sizes: Sequence[int | None]) -> int:
        """Start reading ``names`` (``sizes`` bytes each) in one background batch; returns the
        bytes started. Names already held, unknown sizes and what would pass the bound are skipped."""
        if not self.settings.enabled or self._closed:
            return 0
        now = time.monotonic()
        done = threading.Event()
        picked: list[_Entry] = []
        with self._lock:
            self._expire(now)
            self._last_prefetch = now
            for name, size in zip(names, sizes, strict=True):
                if size is None or size < 0 or name in self._entries:
                    continue
                if self._held + size > self.settings.max_bytes:
                    continue
                e = _Entry(name, size, done, now, self._buffer(size))
                self._entries[name] = e
                self._held += size
                picked.append(e)
            self._publish()
            if picked:
                self._schedule_sweep()
        if not picked:
            return 0
        if self.redirects:
            for e in picked:
                e.landing = Scatter(e.buf)
                e.landing.allow_redirect()
                e.home = e.landing.parts[0]
                e.writer = (e.landing, 0)
                e.landing.on_wrap = lambda dst, e=e: self._wrapped(e, dst)
        try:
            self._pool.submit(self._fetch, picked)
        except RuntimeError:  # closed meanwhile
            self._finish(picked, None)
        return sum(e.size for e in picked)

    def _buffer(self, size: int) -> np.ndarray:
        """A buffer for a read-ahead of ``size`` bytes (lock held): a free one of that size, else a
        new one, after freeing pooled buffers until held + pooled + size fits the bound."""
        free = self._free.get(size)
        if free:
            self._pooled -= size
            self.reused += 1
            buf = free.pop()
            if not free:
                del self._free[size]
            return buf
        limit = self.settings.max_bytes - self._held - size
        while self._free and self._pooled > limit:
            k = next(iter(self._free))
            self._free[k].pop()
            self._pooled -= k
            if not self._free[k]:
                del self._free[k]
        self.allocated += 1
        return np.empty(size, dtype=np.uint8)

    def _wrapped(self, e: _Entry, dst: Scatter) -> None:
        """The sealing layer reads ``e`` through ``dst``: from now on the bytes are written (and
        redirected) there; the landing itself is closed (nothing writes it directly any more). A
        load's buffer given before is carried over, so nothing is copied."""
        with e.lock:
            index = next((i for i, p in enumerate(dst.parts) if p is e.home or p is e.redirected), None)
            if index is None or e.landing is None:
                return  # not our part: the landing stays the writer
            dst.allow_redirect()
            e.landing.close()
            e.writer = (dst, index)
            if e.redirected is not None and dst.parts[index] is not e.redirected:
                dst.redirect(index, e.redirected)  # open (the read has not started): accepted

    def _redirect(self, e: _Entry, buf: Buffer | None) -> None:
        """Point a read-ahead still on its way at the load's ``buf`` (when it is one flat buffer
        of the entry's size): what landed is copied once, the rest lands there. Refused once the
        read is over (its Scatter closed): the bytes then stay in the read-ahead's buffer, where
        every stage (checksum, decryption) runs, and the load copies them once they are served."""
        if e.writer is None or buf is None or e.done.is_set():
            return
        if isinstance(buf, Scatter):
            if len(buf.parts) != 1 or buf.nbytes != e.size or buf.hasher is not None:
                return
            view = buf.parts[0]
        else:
            try:
                view = check_buffer_size(e.name, e.size, buf)
            except (StoreError, TypeError, ValueError):
                return  # _serve reports it
        with e.lock:
            writer, index = e.writer
            copied = writer.redirect(index, view)
            if copied is None:  # closed: the read is over
                return
            e.redirected = view
        self.redirected += 1
        self.redirect_copied += copied

    def _take_back(self, e: _Entry) -> bool:
        """Point a read the load stops waiting for back at the read-ahead's own buffer; False when
        the read is over (its Scatter closed): its stages may still be running in the load's
        buffer, which the load must not reuse before :meth:`Scatter.wait_settled`."""
        with e.lock:
            if e.redirected is not None and e.writer is not None and e.home is not None:
                if e.writer[0].redirect(e.writer[1], e.home) is None:
                    return False
                e.redirected = None
            return True

    def _fetch(self, entries: list[_Entry]) -> None:
        try:
            results = self.inner.get_many([e.name for e in entries],
                                          [e.buf if e.landing is None else e.landing for e in entries])
        except Exception as e:  # the whole call failed: the loads ask the store themselves
            err = e if isinstance(e, StoreError) else StoreError(f"read-ahead failed: {e}")
            results = [ItemResult(x.name, error=err) for x in entries]
        finally:
            for e in entries:  # every stage is done (a sealing layer settled its own Scatters)
                if e.writer is not None:
                    e.writer[0].settle()
                if e.landing is not None:
                    e.landing.settle()
        self._finish(entries, results)

    def _finish(self, entries: list[_Entry], results: list[ItemResult] | None) -> None:
        landed = 0
        with self._lock:
            for i, e in enumerate(entries):
                r = None if results is None else results[i]
                e.result = r
                good = r is not None and r.found and r.size == e.size
                landed += e.size if good else 0
                if e.state == DROPPED:  # forgotten while in flight: its bytes go now
                    self._release(e, wasted=good, recycle=good)
                elif e.state == HELD and not good:  # nothing to serve: the load asks the store
                    del self._entries[e.name]
                    e.state = DROPPED
                    self._release(e, wasted=False, recycle=False)
                # TAKEN: the waiting load releases it
            self._publish()
        self._prefetched.inc(landed)
        if entries:
            entries[0].done.set()

    def _release(self, e: _Entry, *, wasted: bool, recycle: bool) -> None:
        """Give back ``e``'s bytes (lock held); ``wasted``: they had landed and no load took them;
        ``recycle``: its buffer goes to the free pool. Only a buffer whose read succeeded is
        recycled: a failed or abandoned read may still have a worker writing into it."""
        self._held -= e.size
        if recycle and e.buf is not None and not self._closed:
            self._free.setdefault(e.size, []).append(e.buf)
            self._pooled += e.size
            self._schedule_sweep()
        e.buf = None
        if wasted:
            self._wasted.inc(e.size)

    def _drop(self, names: Sequence[str]) -> None:
        """Forget read-aheads of ``names`` (lock held): written, deleted, expired or closed."""
        for n in names:
            e = self._entries.pop(n, None)
            if e is None:
                continue
            e.state = DROPPED
            if e.done.is_set():  # landed (a failed one left the table when it finished)
                self._release(e, wasted=True, recycle=True)
            # else: the fetch finishing releases it (its buffer is still being written)

    def _expire(self, now: float) -> None:
        ttl = self.settings.ttl_secs
        old = [n for n, e in self._entries.items() if now - e.born > ttl]
        if old:
            self._drop(old)
            self._publish()

    def _schedule_sweep(self) -> None:
        """Expire untaken entries even when no call comes (lock held)."""
        if self._sweeper is not None or self._closed:
            return
        t = threading.Timer(self.settings.ttl_secs + 0.05, self._sweep)
        t.daemon = True
        t.name = "kvbucket-read-ahead-sweep"
        self._sweeper = t
        t.start()

    def _sweep(self) -> None:
        with self._lock:
            self._sweeper = None
            now = time.monotonic()
            self._expire(now)
            if self._free and now - self._last_prefetch > self.settings.ttl_secs:
                self._free.clear()  # no read-ahead for a while: give the memory back
                self._pooled = 0
                self._publish()
            if self._entries or self._free:
                self._schedule_sweep()

    def _take(self, name: str) -> _Entry | None:
        with self._lock:
            e = self._entries.pop(name, None)
            if e is not None:
                e.state = TAKEN  # the load owns it now
        return e

    # ---- the protocol -------------------------------------------------------------------
    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        if not self._entries:
            return self.inner.get_many(names, out)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        began = time.monotonic()
        with self._lock:
            self._expire(began)
        taken = [self._take(n) for n in names]
        rest = [i for i, e in enumerate(taken) if e is None]
        results: list[ItemResult | None] = [None] * len(names)
        for i, e in enumerate(taken):  # all before any wait: the rest of each lands in place
            if e is not None:
                self._redirect(e, None if out is None else out[i])
        self._ask(rest, names, out, results)  # what no lookup read ahead, while the read-aheads finish
        again: list[int] = []
        copies: list[tuple[_Entry, Any, np.ndarray]] = []
        for i, e in enumerate(taken):
            if e is None:
                continue
            r = self._serve(e, None if out is None else out[i], copies, began)
            if r is None:
                again.append(i)
            else:
                results[i] = r
        if copies:
            self._copy(copies)
        self._ask(again, names, out, results)  # read-aheads that failed or did not finish: one request
        return results  # type: ignore[return-value]

    def _ask(self, idx: list[int], names: Sequence[str], out: Sequence[Buffer | None] | None,
             results: list[ItemResult | None]) -> None:
        if idx:
            bufs = None if out is None else [out[i] for i in idx]
            for i, r in zip(idx, self.inner.get_many([names[i] for i in idx], bufs), strict=True):
                results[i] = r

    def _serve(self, e: _Entry, buf: Buffer | None, copies: list[tuple[_Entry, Any, np.ndarray]],
               began: float) -> ItemResult | None:
        """The load's result from a read-ahead, or None when the store must be asked. A copy into
        ``buf`` is appended to ``copies`` (done by :meth:`_copy`, which releases the entry).

        The gate of served bytes (docs/integrity.md, "Every byte served is the byte verified"): a
        read-ahead's result is found only once its batch returned from the verifying store, i.e.
        after every stage (checksum, decryption) ran on the bytes where they stay; a redirect is
        refused once the read is over (:meth:`Scatter.close`), so those are the load's buffer when
        it was redirected in time, else the read-ahead's buffer, copied from here.

        One budget (``budget``: the store's load deadline): the read-ahead began with the lookup,
        and the load waits for it only until that read's deadline; a read-ahead that ran out of
        time or failed as a sick store fails (a transient error) is the answer of a load that was
        waiting for it, not a reason to spend a second budget on another request."""
        budget = self._budget
        end = e.born + budget + READ_AHEAD_GRACE_SECS if budget is not None else began + self.wait_secs
        e.done.wait(max(0.0, end - time.monotonic()))
        if not e.done.is_set() and not self._take_back(e):
            # The read is over and its checks may still run in the load's buffer (CPU work, no
            # network): the buffer is the load's again only once they are done.
            assert e.writer is not None
            e.writer[0].wait_settled()
        with self._lock:
            if not e.done.is_set():  # still on its way: its fetch releases it
                e.state = DROPPED
                if budget is None:
                    return None
                return ItemResult(e.name, error=DeadlineExceededError(
                    f"a load on {self.url} waited for its read-ahead (begun by the lookup) past the store's "
                    f"load budget of {budget:g}s, which the two share. Check that the store is reachable, "
                    "or raise its load timeout"))
            r, data = e.result, e.buf
            e.state = DROPPED
            good = r is not None and r.found and r.size == e.size and data is not None
            in_place = good and e.redirected is not None
            if not good or buf is None or in_place:  # None: the caller keeps the buffer itself
                self._release(e, wasted=False, recycle=in_place)
                self._publish()
        if not good or data is None:
            err = None if r is None else r.error
            if budget is not None and isinstance(err, TransientStoreError) and began < e.born + budget:
                return ItemResult(e.name, error=err)  # the load's own request failed this way
            return None
        self._used.inc(e.size)
        if in_place:
            return ItemResult(e.name, size=e.size, data=buf)
        if buf is None:
            return ItemResult(e.name, size=e.size, data=data)
        try:
            view = check_buffer_size(e.name, e.size, buf)
        except StoreError as err:
            copies.append((e, None, data))  # nothing to copy: only released
            return ItemResult(e.name, error=err)
        copies.append((e, view, data))
        return ItemResult(e.name, size=e.size, data=buf)

    def _copy(self, copies: list[tuple[_Entry, Any, np.ndarray]]) -> None:
        """Copy landed read-aheads into the callers' buffers, half on a helper thread when it pays
        (``numpy.copyto`` releases the GIL), then recycle their buffers. A helper that has not
        started when this thread is done (busy with another load, or stopped) is called off and
        its half copied here: every result served is copied before it is returned."""
        helper = None
        mine, theirs = copies, copies[:0]
        if sum(e.size for e, v, _ in copies if v is not None) >= PARALLEL_COPY_BYTES and len(copies) > 1:
            mine, theirs = copies[0::2], copies[1::2]
            try:
                helper = self._copier.submit(_copy_each, theirs)
            except RuntimeError:  # stopped meanwhile
                mine, theirs = copies, copies[:0]
        try:
            _copy_each(mine)
            if helper is not None:
                if helper.cancel():
                    _copy_each(theirs)
                else:
                    helper.result()
        finally:
            if helper is not None and not helper.cancel():  # running or done: never recycle what
                wait([helper])  # it still reads (a cancelled one never runs: nothing to wait for)
            with self._lock:
                for e, _, _ in copies:
                    self._release(e, wasted=False, recycle=True)
                self._publish()

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        # forgotten after too: read-aheads a lookup started meanwhile may hold the old bytes
        return self._forgetting([n for n, _ in items], lambda: self.inner.put_many(items))

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self._forgetting(names, lambda: self.inner.delete_many(names))

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        return self._forgetting([n for n, _ in items], lambda: self.inner.delete_versions(items))

    def _forgetting(self, names: Sequence[str], call: Callable[[], Any]) -> Any:
        self.forget(names)
        try:
            return call()
        finally:
            self.forget(names)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.head_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, page_size=page_size)

    def forget(self, names: Sequence[str]) -> None:
        """Drop read-aheads of ``names`` (their objects change or go). A writer calls it before
        and again after its write returns: a lookup during the write may have started reading
        the old bytes ahead, and a read-ahead begun before a write completed is never served
        after it (one begun after reads what the write left)."""
        if self._entries:
            with self._lock:
                self._drop(names)
                self._publish()

    def drop_unused(self, names: Sequence[str]) -> list[str]:
        """Forget the read-aheads of ``names`` no load took (landed or on their way; counted
        wasted when they land) and return those names: for a caller told that no load will come
        (LMCache's L2 adapter, when LMCache unlocks a key it did not load from it)."""
        if not self._entries:
            return []
        with self._lock:
            unused = [n for n in names if n in self._entries]
            self._drop(unused)
            self._publish()
        return unused

    def close(self) -> None:
        self.stop()
        self.inner.close()

    def stop(self) -> None:
        """Drop every read-ahead and start no more; the inner store stays open (its owner closes it)."""
        if not self._closed:
            self._closed = True
            with self._lock:
                self._drop(list(self._entries))
                self._free.clear()
                self._pooled = 0
                self._publish()
                if self._sweeper is not None:
                    self._sweeper.cancel()
                    self._sweeper = None
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._copier.shutdown(wait=False, cancel_futures=True)


def _copy_each(copies: Sequence[tuple[_Entry, Any, np.ndarray]]) -> None:
    for _, view, data in copies:
        if isinstance(view, memoryview):
            np.copyto(np.frombuffer(view, dtype=np.uint8), data)  # no GIL held for the bytes
        elif view is not None:  # a Scatter
            view[:] = memoryview(data)


def with_read_ahead(store: ObjectStore, settings: ReadAheadSettings | None, *, label: str) -> ObjectStore:
    """``store`` behind a read-ahead buffer when ``settings`` enable one, else ``store`` itself."""
    if settings is None or not settings.enabled or settings.max_bytes <= 0:
        return store
    return PrefetchStore(store, settings, label=label)


def drop_unused(store: Any, names: Sequence[str]) -> list[str]:
    """:meth:`PrefetchStore.drop_unused` on ``store`` if it has a read-ahead buffer (else [])."""
    if not names or not getattr(store, "prefetches", False):
        return []
    return list(store.drop_unused(names))


def read_ahead(store: Any, names: Sequence[str], sizes: Sequence[int | None]) -> int:
    """Start loading a lookup's hits into ``store``'s read-ahead buffer, if it has one (else 0)."""
    if not names or not getattr(store, "prefetches", False):
        return 0
    return int(store.prefetch(names, sizes))


__all__ = [
    "READ_AHEAD_BYTES", "READ_AHEAD_HELD", "READ_AHEAD_POOLED", "PrefetchStore", "ReadAheadConfig",
    "ReadAheadSettings", "drop_unused", "read_ahead", "with_read_ahead",
]
