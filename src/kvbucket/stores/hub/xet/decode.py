"""Fetched Xet ranges into the caller's buffer: the compiled decoder, or the pure-Python one.

A fetched range is a run of chunks (8-byte header, then raw, LZ4-frame or byte-grouped LZ4-frame
payload: :mod:`.kernel` describes the format). Two ways to lay them out at their offsets in
the object, giving the same bytes (tests/hfbucket/test_xet_decode.py compares them on random and
bf16 KV data, every scheme and frame option, odd lengths and window boundaries):

- **compiled** (:mod:`.kernel`, numba): one call per window of fetched bytes walks the chunk
  headers and decodes every chunk of a term straight into the destination, the GIL released;
- **pure Python**: per chunk, ``lz4.frame.decompress`` (python-lz4: the reference for which
  frames are valid), then a byte-grouped chunk is ungrouped by four strided numpy copies straight
  into the destination (:func:`ungroup`, in place as the compiled decoder writes; into the window
  and item-written where several terms share the chunk or it straddles two parts of a Scatter),
  any other chunk one item write ``dst[a:b] = data``. Both steps run without the GIL. It is what
  a cold process's first hit of compressed chunks runs (below): 30% less CPU than ungrouping with
  bytearray slice assignments and copying the result twice (0.15 against 0.105 s per 128 MiB of
  bf16 KV). Kept as the fallback: where numba is missing, for what the compiled decoder declines
  (a header or frame option it does not know: that chunk only, so the error a user sees is the
  same), and selectable.

``KVBUCKET_XET_DECODER``: ``auto`` (default) uses the compiled decoder once it is loaded and the
pure-Python one meanwhile: the first *compressed* chunk a process meets asks for it, and a
background thread loads it (0.3-0.5 s of CPU from numba's cache, ~2 s the first time on a
machine, when it is compiled) once no object is being read and none was for ``IDLE_SECS`` (the
hit that asked is over), or ``LOAD_WAIT_SECS`` after it was asked for in a process that never idles,
except in a big hit (``BIG_HIT_BYTES``, below), whose compressed chunks wait for it as ``numba``'s
do; ``numba`` waits for it at that chunk; ``python`` never uses it (the whole test suite runs once
so). Why after a small hit: the load (numba's import and the kernel from its cache) is CPU under
the GIL that a fresh process's first hit would share; measured against the load beside the hit,
cold hits of bf16 KV were as fast or faster (medians 1.01-1.42x over 64 x 2, 16 x 8 and 16 x 32
MiB at 0, 20 and 50 ms; issue 41, docs/hfbucket.md). Why a big hit waits instead: loaded beside
a hit, the load never ends before it (64 threads decoding the Python way hand the GIL around, and
the loading thread, whose imports release it at every file read, waits its turn each time: begun
0.2 s into a cold 64 x 32 MiB hit it ended 4-7 s later, after the hit), while waiting costs the
load once (0.4-0.7 s) and decodes the rest compiled: a cold 64 x 32 MiB hit on loopback took
2.56-3.25 s waiting against 5.56-7.11 s after it, but a 16 x 32 MiB one 1.10-1.85 against
0.94-1.36 s (load 6-7, 2 cores; cold41 branch, issue 41).

**Invariant (a hit pays nothing for a decoder it does not use).** Nothing but :func:`_one`
meeting a compressed chunk (and :func:`kernel` called by a user who asks for it) starts the
load: a raw chunk is one item write either way, and ``import numba`` alone holds the GIL for
0.3 s, which a fresh process's first hit of objects stored uncompressed would otherwise pay
(tests/hfbucket/test_xet_decode.py::test_uncompressed_loads_never_import_numba). A hit of
compressed chunks smaller than ``BIG_HIT_BYTES`` does not pay for it either: the load waits
until the reads are idle, and a read waiting for its bytes is not idle (the rule was "no range
decoded for IDLE_SECS": one object's fetch arriving late let the load start inside the hit,
tests/hfbucket/test_xet_decode.py::test_a_late_object_keeps_the_decoder_load_after_the_hit).

**Invariant (a big hit waits for the compiled decoder).** Every object read (``XetReader.read_into``,
a run of objects in ``read_run``) counts its bytes in :func:`reading` from before it waits for its
reconstruction until it ends. A compressed chunk met while the reads counted add up to
``BIG_HIT_BYTES`` or more loads the compiled decoder then and there
and waits for it (:func:`_one` asks, :func:`kernel` decides), as ``numba`` does; the other ranges
switch to it at their next chunk. Smaller hits keep the idle rule. A big hit of raw chunks still
loads nothing: only a compressed chunk asks (tests/hfbucket/test_xet_decode.py::
test_a_big_compressed_hit_waits_for_the_compiled_decoder). The wait is numba's cache load, or
the first compile on a machine (~2 s) once.

**Invariant (where decoded bytes land).** A byte reaches the caller's destination in one of two
ways, both of which keep the rules item writes keep: an item write ``dst[a:b] = data``, or an
in-place decode run by :func:`_in_place`, which holds the read's :class:`Gate` (an abandoned read
writes nothing) and, for a :class:`Scatter`, goes through :meth:`Scatter.fill` (under the
redirect lock, recorded for a redirect's copy, fed to the hash) into one part. No decoder keeps a
view of the destination between calls: a read-ahead redirect (stores/guard/read_ahead.py) moves a part
between two writes, never under one.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbucket.errors import StoreError, TransientStoreError
from kvbucket.stores.base import Scatter
from kvbucket.stores.deadline import Gate
from kvbucket.stores.hub.xet.turns import Turn
from kvbucket.threads import in_daemon_thread

log = logging.getLogger(__name__)

DECODER_ENV = "KVBUCKET_XET_DECODER"
DECODERS = ("auto", "numba", "python")
MAX_CHUNK = 1 << 20  # chunks are ~64 KiB (at most 128 KiB); a header beyond this is garbage
#: A body's parse window: holds any chunk hf_xet writes (<= 128 KiB, + 8) with room; grows for a larger one
WINDOW = 256 << 10
#: The compiled decoder, once asked for, loads after no object was being read for this long
IDLE_SECS = 0.1
#: ... or this long after it was asked for, whatever the reads do (a process that never idles)
LOAD_WAIT_SECS = 5.0
#: A compressed chunk met while object reads of at least this many bytes are in progress (a big
#: hit) waits for the compiled decoder (see the module doc): measured against waiting, 16 x 32 MiB
#: of bf16 KV was faster decoded the Python way, 64 x 32 MiB slower
BIG_HIT_BYTES = 768 << 20


class XetReadUnsupported(Exception):
    """The reconstruction or the bytes are not what this reader knows: use hf_xet instead."""


# ---- choosing the decoder -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Kernel:
    """The compiled decoder: :func:`.kernel.decode_run` and the C LZ4 decoder's address."""

    run: Callable[..., None]
    lz4: int
    outcomes: tuple[int, int, int, int, int]  # DONE, NEED, BAD_HEADER, BAD_PAYLOAD, NO_ROOM


_lock = threading.Lock()  # guards _loading (held briefly; never while loading)
_load_lock = threading.Lock()  # held while loading
_kernel: Kernel | None = None
_failed: str | None = None
_loading: Any = None  # the background load's future
_busy = 0  # fetched ranges being decoded now (copy_range calls running)
_idle_since = 0.0  # when the last range decoded or object read ended
_reading = 0  # bytes of the object reads in progress (:func:`reading`)


#: A fork waits this long for a load in progress to end (see _before_fork)
FORK_WAIT_SECS = 60.0
_fork_held = False


def _before_fork() -> None:
    """A fork waits for a load in progress: the loading thread holds Python's import lock of
    the kernel module, and a child forked then inherits that lock held by a thread it does not
    have. Its first load then waited forever (the outside tester's child: every item at its
    load deadline) or met a half-imported module (Python decoding for the child's life)."""
    global _fork_held
    _fork_held = _load_lock.acquire(timeout=FORK_WAIT_SECS)


def _after_fork_in_parent() -> None:
    global _fork_held
    if _fork_held:
        _fork_held = False
        _load_lock.release()


def _after_fork() -> None:
    """A forked child starts with fresh locks and loads again unless the parent had loaded; if
    the fork could not wait for the parent's load, the child never imports the kernel (its
    import lock may be held by a thread the child does not have) and decodes the Python way."""
    global _lock, _load_lock, _loading, _busy, _reading, _failed, _fork_held
    _lock, _load_lock, _loading, _busy, _reading = threading.Lock(), threading.Lock(), None, 0, 0
    if not _fork_held and _kernel is None and _failed is None:
        _failed = f"the process forked while its parent loaded it for more than {FORK_WAIT_SECS:.0f} s"
        log.warning("the compiled Xet decoder is not available in this forked process (%s); Hub reads "
                    "decode in Python", _failed)
    _fork_held = False


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork)


def decoder_mode() -> str:
    """``KVBUCKET_XET_DECODER``, checked (an unknown value is reported and read as auto)."""
    raw = os.environ.get(DECODER_ENV, "auto").strip().lower() or "auto"
    if raw not in DECODERS:
        log.warning("ignoring %s=%r: use one of %s", DECODER_ENV, raw, ", ".join(DECODERS))
        return "auto"
    return raw


def compiled() -> Kernel | None:
    """The compiled decoder, loaded now if it is not yet, whatever ``KVBUCKET_XET_DECODER`` says
    (None where numba is missing)."""
    global _kernel, _failed
    with _load_lock:
        if _kernel is not None or _failed is not None:
            return _kernel
        try:
            if sys.byteorder != "little":
                raise ImportError("the compiled Xet decoder assumes a little-endian host")
            from kvbucket.stores.hub.xet import kernel as k
            _kernel = Kernel(k.decode_run, k.lz4_address(), (k.DONE, k.NEED, k.BAD_HEADER, k.BAD_PAYLOAD,
                                                             k.NO_ROOM))
        except Exception as e:  # numba missing or failing: the pure-Python decoder does the work
            _failed = f"{type(e).__name__}: {e}"
            log.warning("the compiled Xet decoder is not available (%s); Hub reads decode in Python, "
                        "holding the GIL (pip install numba)", _failed)
        return _kernel


def kernel(*, wait: bool = False) -> Kernel | None:
    """The compiled decoder to use now, or None for the pure-Python one (see the module doc)."""
    global _loading
    mode = decoder_mode()
    if mode == "python":
        return None
    if _kernel is not None or _failed is not None:
        return _kernel
    if wait or mode == "numba" or _reading >= BIG_HIT_BYTES:  # a big hit waits (see the module doc)
        return compiled()
    if _loading is None:  # asked once: every compressed chunk of a hit calls this
        with _lock:
            if _loading is None:
                _loading = in_daemon_thread(_load_when_idle, "kvbucket-xet-decoder-load")
    return None


def _load_when_idle() -> Kernel | None:
    """Load the compiled decoder once no range is being decoded (see the module doc)."""
    give_up = time.monotonic() + LOAD_WAIT_SECS
    while True:
        now = time.monotonic()
        with _lock:
            idle = _busy == 0 and _reading == 0 and now - _idle_since >= IDLE_SECS
        if idle or now >= give_up:
            return compiled()
        time.sleep(IDLE_SECS / 2)


@contextlib.contextmanager
def reading(nbytes: int) -> Iterator[None]:
    """Count an object read's ``nbytes`` while it runs: what tells a big hit (``BIG_HIT_BYTES``)
    before its chunks arrive. Counted per object, not per ranged GET: a load's objects are read at
    once (``load_concurrency``) while their GETs start in waves, so the GETs in flight of a 1 GiB
    hit did not always add up to its size."""
    global _reading, _idle_since
    with _lock:
        _reading += nbytes
    try:
        yield
    finally:
        with _lock:
            _reading -= nbytes
            _idle_since = time.monotonic()


def ready() -> Kernel | None:
    """The compiled decoder if it is loaded (and not turned off), without starting its load."""
    return None if _kernel is None or decoder_mode() == "python" else _kernel


def decode_chunk(scheme: int, payload: memoryview, n: int) -> bytes | memoryview:
    """One chunk's bytes, the pure-Python way (``n``, the announced length, is checked by the caller)."""
    data = decompressed(scheme, payload, n)
    if scheme == 2 and len(data) == n:
        out = np.empty(n, np.uint8)
        ungroup(data, out)
        return memoryview(out)
    return data


def decompressed(scheme: int, payload: memoryview, n: int) -> bytes | memoryview:
    """A chunk's payload with its LZ4 frame undone (the pure-Python way): still byte-grouped for
    scheme 2 (:func:`ungroup` lays it out). Raises :class:`StoreError` for a frame python-lz4
    refuses; the length is the caller's to check against ``n``."""
    if scheme == 0:
        return payload
    import lz4.frame

    _check_content_size(payload, n)
    try:
        return lz4.frame.decompress(payload)  # type: ignore[no-any-return]
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise StoreError(f"a fetched chunk is not a valid LZ4 frame: {type(e).__name__}: {e}") from None


def ungroup(grouped: Any, out: np.ndarray) -> None:
    """Undo byte grouping 4 into ``out`` (uint8, the chunk's length ``n``): lane k (``(n - k + 3)
    // 4`` bytes, the lanes concatenated in ``grouped``) goes to ``out[k::4]``. One strided numpy
    copy per lane, without the GIL: twice as fast as four bytearray slice assignments plus the
    copies into bytes and then into the destination (34 against 20 us of CPU per 64 KiB chunk of
    bf16 KV; decompressing it is 16 us), and written straight where the bytes belong."""
    src = np.frombuffer(grouped, np.uint8)
    n, pos = out.size, 0
    for k in range(4):
        lane = (n - k + 3) // 4
        out[k::4] = src[pos : pos + lane]
        pos += lane


def _check_content_size(payload: memoryview, n: int) -> None:
    """Refuse a frame whose header announces a content size other than the chunk's ``n`` before
    python-lz4 sees it: it allocates the announced size up front (a size past 2**63 raised a bare
    MemoryError; a large one would be allocated). 0 means "unknown" to liblz4 and is left to it."""
    if len(payload) >= 15 and payload[4] & 0x08 and payload[:4] == b"\x04\x22\x4d\x18":
        size = int.from_bytes(payload[6:14], "little")
        if size not in (0, n):
            raise StoreError(f"a fetched chunk's LZ4 frame announces {size} bytes, its header says {n}")


# ---- the walk over one fetched range --------------------------------------------------------
class Window:
    """Where a fetched body is read and parsed: kept per read slot and reused (see .reads).

    Small (:data:`WINDOW`), growing only for a chunk that does not fit, and not zero-filled:
    every body being read has its own, and a fresh process touches each page of each the first
    time (a cold hit of 64 objects read at once first-touched 64 windows: at 2 MiB each, 60-100
    ms more CPU per hit than at 256 KiB)."""

    __slots__ = ("arr", "chunk", "info", "mv", "scratch")

    def __init__(self, size: int = WINDOW) -> None:
        self._alloc(size)
        self.scratch = np.empty(MAX_CHUNK, dtype=np.uint8)  # a byte-grouped chunk before ungrouping
        self.chunk = np.empty(MAX_CHUNK, dtype=np.uint8)  # a chunk decoded here, then item-written
        self.info = np.zeros(5, dtype=np.int64)

    def _alloc(self, size: int) -> None:
        self.arr = np.empty(size, dtype=np.uint8)
        self.mv = memoryview(self.arr)

    def grow(self, size: int, start: int, end: int) -> None:
        """Room for ``size`` bytes, the unparsed ``[start, end)`` moved to the front."""
        old = self.mv
        self._alloc(size)
        self.mv[: end - start] = old[start:end]


class _Body:
    """The unparsed bytes of a response in ``window[start:end]``; ``left`` still on the socket."""

    __slots__ = ("end", "left", "resp", "size", "start", "turn", "w")

    def __init__(self, resp: http.client.HTTPResponse, w: Window, nbytes: int,
                 turn: Turn | None = None) -> None:
        self.resp, self.w, self.left, self.size = resp, w, nbytes, len(w.mv)
        self.start = self.end = 0
        self.turn = turn  # read_slots: held only while bytes are here (turns.py)

    def ensure(self, n: int) -> None:
        """At least ``n`` unparsed bytes in the window (reading more from the socket)."""
        start, end, mv = self.start, self.end, self.w.mv
        if end - start >= n:
            return
        if n > self.left + end - start:
            raise StoreError("a fetched range ended in the middle of a chunk")
        if n > self.size:  # a chunk larger than the window (at most 8 + MAX_CHUNK: callers check)
            self.w.grow(n, start, end)
            mv, self.size = self.w.mv, n
            end, start = end - start, 0
        elif start + n > self.size:  # move the partial chunk to the front
            mv[: end - start] = mv[start:end]
            end, start = end - start, 0
        want = min(self.size - end, self.left)
        turn = self.turn
        while end - start < n:
            into = mv[end : end + want]
            k = self.resp.readinto(into) if turn is None else turn.read_into(into, n - (end - start))
            if not k:
                raise TransientStoreError("the storage closed the connection in the middle of an object")
            end, self.left, want = end + k, self.left - k, want - k
        self.start, self.end = start, end


def copy_range(resp: http.client.HTTPResponse, nbytes: int, chunks: tuple[int, int],
               targets: tuple[tuple[int, int, int, int], ...], dst: Any, gate: Gate | None, w: Window,
               fast: Kernel | None, lazy: bool = False, turn: Turn | None = None) -> None:
    """Read a fetched range of ``nbytes`` (chunks ``[chunks[0], chunks[1])`` of a xorb) from
    ``resp`` and lay each term of ``targets`` (first chunk, end chunk, offset, length) out at its
    offset in ``dst`` (a memoryview or a :class:`Scatter`), through ``gate``. ``lazy``: ``fast``
    is None only because the compiled decoder is not loaded yet (``ready()``); a compressed chunk
    then asks for its load (after the reads, see the module doc), and it is used once there.
    ``turn``: the fetch's parse turn (``read_slots``, turns.py), held while parsing."""
    global _busy, _idle_since
    with _lock:
        _busy += 1
    try:
        _copy_range(resp, nbytes, chunks, targets, dst, gate, w, fast, lazy, turn)
    finally:
        with _lock:
            _busy -= 1
            _idle_since = time.monotonic()


def _copy_range(resp: http.client.HTTPResponse, nbytes: int, chunks: tuple[int, int],
                targets: tuple[tuple[int, int, int, int], ...], dst: Any, gate: Gate | None, w: Window,
                fast: Kernel | None, lazy: bool, turn: Turn | None) -> None:
    cursor = [off for _, _, off, _ in targets]
    users: dict[int, list[int]] = {}  # chunk index -> the terms that hold it
    for k, (cs, ce, _, _) in enumerate(targets):
        for c in range(cs, ce):
            users.setdefault(c, []).append(k)
    body = _Body(resp, w, nbytes, turn)
    c, last = chunks
    size = len(dst)
    run_end = c  # chunks [c, run_end) all belong to one term only (decoded in place)
    while c < last:
        us = users.get(c)
        if fast is not None and us is not None and len(us) == 1:
            k = us[0]
            if run_end <= c:
                run_end = c + 1
                while run_end < last and users.get(run_end) == us:
                    run_end += 1
            c += _run(fast, body, run_end - c, dst, gate, cursor, k, min(targets[k][2] + targets[k][3], size))
            if c < run_end and _stuck(fast, body):
                c = _one(body, c, users, cursor, dst, gate, size, fast, lazy)  # one chunk, item-written
            continue
        c = _one(body, c, users, cursor, dst, gate, size, fast, lazy)
        if fast is None and lazy:
            fast = ready()  # loaded meanwhile (or by that chunk): used from the next chunk on
    if body.left or body.end != body.start:
        extra = body.left + body.end - body.start
        raise StoreError(f"a fetched range held {extra} bytes more than its chunks")
    for (_, _, off, length), stop in zip(targets, cursor, strict=True):
        if stop - off != length:
            raise StoreError(f"a term's chunks hold {stop - off} bytes; its reconstruction says {length}")


def _run(fast: Kernel, body: _Body, chunks: int, dst: Any, gate: Gate | None, cursor: list[int], k: int,
         limit: int) -> int:
    """Decode up to ``chunks`` chunks of term ``k`` in place at ``cursor[k]``; how many it decoded.
    ``info[3]`` then says why it stopped (more bytes are read here when that is the reason)."""
    w = body.w
    info = w.info
    info[3] = -1

    def write(view: memoryview) -> int:
        out = np.frombuffer(view, dtype=np.uint8)
        fast.run(fast.lz4, w.arr, body.start, body.end, chunks, out, 0, out.size, w.scratch, MAX_CHUNK, info)
        return int(info[2])

    if limit > cursor[k]:
        cursor[k] += _in_place(dst, gate, cursor[k], limit, write)
    if info[3] < 0:  # nothing decoded (no room left, or the term starts in another part)
        info[1] = 0
        return 0
    body.start = int(info[0])
    if info[3] == fast.outcomes[1]:  # NEED: read on; the next call decodes it
        body.ensure(int(info[4]))
        info[3] = fast.outcomes[0]
    return int(info[1])


def _stuck(fast: Kernel, body: _Body) -> bool:
    """Whether the compiled decoder declined the next chunk (it goes the Python way)."""
    return int(body.w.info[3]) not in (fast.outcomes[0], fast.outcomes[1])


def _in_place(dst: Any, gate: Gate | None, start: int, limit: int, write: Callable[[memoryview], int]) -> int:
    """Let ``write`` fill the destination from ``start`` (up to ``limit``) in place; the bytes it
    wrote. The one place an in-place decode touches a caller's buffer (see the module doc)."""
    if gate is not None:
        return gate.run(_in_place, dst, None, start, limit, write)
    if isinstance(dst, Scatter):
        return dst.fill(start, limit, write)
    return write(dst[start:limit])


def _one(body: _Body, c: int, users: dict[int, list[int]], cursor: list[int], dst: Any, gate: Gate | None,
         size: int, fast: Kernel | None, lazy: bool = False) -> int:
    """Chunk ``c`` decoded on its own and item-written to each term that holds it (a chunk several
    terms share, one that straddles two parts of a Scatter, one the compiled decoder declined in
    place, or every chunk without it); the next chunk. Decoded by the compiled decoder into a
    scratch buffer when it accepts the chunk, else the pure-Python way (which raises for a bad one)."""
    body.ensure(8)
    mv, start = body.w.mv, body.start
    if mv[start] != 0:
        raise XetReadUnsupported(f"chunk header version {mv[start]}")
    clen = int.from_bytes(mv[start + 1 : start + 4], "little")
    scheme = mv[start + 4]
    ulen = int.from_bytes(mv[start + 5 : start + 8], "little")
    if clen > MAX_CHUNK or ulen > MAX_CHUNK or scheme > 2:
        raise XetReadUnsupported(f"chunk header out of bounds ({clen}, {scheme}, {ulen})")
    body.ensure(8 + clen)
    start = body.start
    payload = body.w.mv[start + 8 : start + 8 + clen]
    body.start = start + 8 + clen
    if c not in users:
        return c + 1
    data: Any = None
    if fast is None and lazy and scheme != 0 and (_loading is None or _reading >= BIG_HIT_BYTES):
        fast = kernel()  # a compressed chunk asks for the compiled decoder; a big hit's waits (module doc)
    if fast is not None:
        w = body.w
        end = start + 8 + clen
        fast.run(fast.lz4, w.arr, start, end, 1, w.chunk, 0, MAX_CHUNK, w.scratch, MAX_CHUNK, w.info)
        if w.info[3] == fast.outcomes[0]:
            data = memoryview(w.chunk)[:ulen]
    grouped = False
    if data is None:
        data = decompressed(scheme, payload, ulen)
        grouped = scheme == 2
    if len(data) != ulen:
        raise StoreError(f"a chunk decoded to {len(data)} bytes, its header says {ulen}")
    terms = users[c]
    if grouped and len(terms) > 1:  # a shared chunk: ungrouped once, then item-written to each
        data, grouped = _ungrouped_in(body.w, data, ulen), False
    for k in terms:
        off = cursor[k]
        if off + ulen > size:
            raise StoreError("the reconstruction places bytes past the end of the object")
        if grouped:
            _place_grouped(body.w, data, dst, gate, off, ulen)
        elif gate is None:
            dst[off : off + ulen] = data
        else:
            gate.write(dst, off, data)
        cursor[k] = off + ulen
    return c + 1


def _ungrouped_in(w: Window, grouped: Any, n: int) -> memoryview:
    """``grouped`` ungrouped into the window's chunk buffer (valid until its next use)."""
    out = w.chunk[:n]
    ungroup(grouped, out)
    return memoryview(out)


def _place_grouped(w: Window, grouped: Any, dst: Any, gate: Gate | None, off: int, n: int) -> None:
    """A byte-grouped chunk's bytes at ``dst[off:off + n]``: ungrouped straight into the
    destination (in place, see the module doc), or, where no one part of a Scatter holds them all,
    ungrouped into the window first and item-written."""

    def write(view: memoryview) -> int:
        if len(view) < n:
            return 0
        ungroup(grouped, np.frombuffer(view, np.uint8, n))
        return n

    if _in_place(dst, gate, off, off + n, write) != n:
        data = _ungrouped_in(w, grouped, n)
        if gate is None:
            dst[off : off + n] = data
        else:
            gate.write(dst, off, data)


__all__ = ["BIG_HIT_BYTES", "DECODERS", "DECODER_ENV", "IDLE_SECS", "LOAD_WAIT_SECS", "MAX_CHUNK", "WINDOW",
           "Kernel", "Window", "XetReadUnsupported", "compiled", "copy_range", "decode_chunk", "decoder_mode",
           "decompressed", "kernel", "reading", "ready", "ungroup"]
