"""The Xet chunk decoder compiled by numba: many chunks per call, without the GIL.

Why numba: a fetched range is ~16,000 chunks per GiB, so anything done per chunk in Python
(a ``lz4.frame.decompress`` call, a copy of the bytes it returns, four slice assignments undoing
the byte grouping) holds the GIL for most of a load. One compiled call walks the chunk headers
of a window of fetched bytes, decompresses each LZ4 frame straight into the destination (a
byte-grouped chunk into a small scratch first, then ungrouped into the destination) and returns,
with the GIL released throughout (``nogil``). numba ships as wheels (LMCache and vLLM already
depend on it): no compiler on the user's machine. Compiled once per machine (``cache``: a few
seconds the first time, then loaded from numba's cache).

Formats (xet-core's ``xorb_object``; LZ4 frame format 1.6.x): a chunk is an 8-byte header
``[version u8 = 0][compressed_len u24][scheme u8][uncompressed_len u24]`` (little-endian) then
its payload: scheme 0 raw, 1 one LZ4 frame, 2 one LZ4 frame of the byte-grouped chunk (lanes
``data[k::4]`` for k = 0..3 concatenated; lane k holds ``(n - k + 3) // 4`` bytes). Frames may
hold several blocks (independent or linked), raw blocks and a content size (checked): hf_xet
1.8 writes independent 64 KiB or 256 KiB blocks, no checksums, no size (FLG 0x60). The frame
header is checked as liblz4 (python-lz4's decoder) checks it: reserved FLG and BD bits, the
block size id, the header checksum byte, a content size with its top bit set; and no block
larger than the frame's block size. Anything else it does not do (block or content checksums,
which python-lz4 verifies; dictionary ids; trailing bytes, which python-lz4 ignores) or that
does not decode to the announced length is declined, and the caller re-decodes that chunk the
pure-Python way, which raises the error a user sees or gives its bytes. So the compiled decoder
may decline a chunk the Python one accepts (it then goes the Python way), never accepts one the
Python one refuses, and what it accepts it decodes to the same bytes: a load gives the same
bytes or the same error either way (tests/hfbucket/test_xet_hostile_frames.py mutates valid
frames by the thousand to check it).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: Outcomes of :func:`decode_run` (``info[3]``).
DONE = 0  # decoded the chunks asked for
NEED = 1  # the next chunk is not all in the window: ``info[4]`` bytes are needed from ``start``
BAD_HEADER = 2  # the next chunk's header is not one this decoder knows
BAD_PAYLOAD = 3  # the next chunk's payload did not decode to its announced length
NO_ROOM = 4  # the next chunk does not fit before ``limit``

_FRAME_MAGIC = 0x184D2204


@njit(cache=True, nogil=True)
def _u32(b: np.ndarray, i: int) -> int:
    return (np.int64(b[i]) | (np.int64(b[i + 1]) << 8) | (np.int64(b[i + 2]) << 16)
            | (np.int64(b[i + 3]) << 24))


@intrinsic
def _copy(typingctx: Any, src: Any, ip: Any, dst: Any, op: Any, n: Any) -> Any:
    """``dst[op:op + n] = src[ip:ip + n]`` as one ``memmove`` (numba's slice assignment checks
    for overlap, may copy through a temporary array, and copies byte by byte). Bounds are the
    caller's to check."""
    sig = types.void(src, ip, dst, op, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        s, i, d, o, k = args
        sarr = context.make_array(signature.args[0])(context, builder, s)
        darr = context.make_array(signature.args[2])(context, builder, d)
        cgutils.raw_memmove(builder, builder.gep(darr.data, [o]), builder.gep(sarr.data, [i]), k, 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _ptr(typingctx: Any, arr: Any, off: Any) -> Any:
    """The address of ``arr[off]`` (for a C call)."""
    sig = types.voidptr(arr, off)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a, o = args
        aa = context.make_array(signature.args[0])(context, builder, a)
        return builder.bitcast(builder.gep(aa.data, [o]), ir.IntType(8).as_pointer())

    return sig, codegen


@intrinsic
def _call_lz4(typingctx: Any, fn: Any, src: Any, dst: Any, n: Any, cap: Any, dict_: Any, dict_n: Any) -> Any:
    """``LZ4_decompress_safe_usingDict(src, dst, n, cap, dict_, dict_n)`` at address ``fn``. Why
    an address and not a ctypes function: numba caches nothing that holds a ctypes pointer, and
    the address differs in every process."""
    sig = types.int64(fn, src, dst, n, cap, dict_, dict_n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f, sp, dp, k, c, dd, dn = args
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(i32, [i8p, i8p, i32, i32, i8p, i32])
        ints = [builder.trunc(x, i32) for x in (k, c, dn)]
        call = builder.call(builder.inttoptr(f, fnty.as_pointer()), [sp, dp, ints[0], ints[1], dd, ints[2]])
        return builder.sext(call, ir.IntType(64))

    return sig, codegen


def lz4_address() -> int:
    """The address of the reference LZ4 block decoder in python-lz4's extension (its symbols are
    exported on Linux and macOS), or 0 (then the decoder below is used)."""
    try:
        import lz4.block._block as mod

        fn = ctypes.CDLL(mod.__file__).LZ4_decompress_safe_usingDict
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    except (ImportError, OSError, AttributeError):
        return 0


@njit(cache=True, nogil=True)
def _c_block(fn: int, src: np.ndarray, ip: int, iend: int, dst: np.ndarray, op: int, oend: int,
             ostart: int) -> int:
    d = min(op - ostart, 65536)
    n = _call_lz4(fn, _ptr(src, ip), _ptr(dst, op), iend - ip, oend - op, _ptr(dst, op - d), d)
    return -1 if n < 0 else op + n


@njit(cache=True, nogil=True)
def _block(src: np.ndarray, ip: int, iend: int, dst: np.ndarray, op: int, oend: int, ostart: int) -> int:
    """Decode one LZ4 block ``src[ip:iend]`` into ``dst[op:oend]`` (matches may reach back to
    ``ostart``); the end of the output, or -1."""
    while True:
        if ip >= iend:
            return -1
        token = np.int64(src[ip])
        ip += 1
        lit = token >> 4
        if lit == 15:
            while True:
                if ip >= iend:
                    return -1
                b = np.int64(src[ip])
                ip += 1
                lit += b
                if b != 255:
                    break
        if ip + lit > iend or op + lit > oend:
            return -1
        _copy(src, ip, dst, op, lit)
        ip += lit
        op += lit
        if ip == iend:
            return op  # a block ends with literals
        if ip + 2 > iend:
            return -1
        off = np.int64(src[ip]) | (np.int64(src[ip + 1]) << 8)
        ip += 2
        ml = token & 15
        if ml == 15:
            while True:
                if ip >= iend:
                    return -1
                b = np.int64(src[ip])
                ip += 1
                ml += b
                if b != 255:
                    break
        ml += 4
        if off == 0 or off > op - ostart or op + ml > oend:
            return -1
        m = op - off
        while ml > 0:  # an overlapping match repeats the last ``off`` bytes: copies of doubling size
            k = min(ml, op - m)
            _copy(dst, m, dst, op, k)
            op += k
            ml -= k


_M32 = 0xFFFFFFFF


@njit(cache=True, nogil=True)
def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


@njit(cache=True, nogil=True)
def _xxh32_short(b: np.ndarray, i: int, n: int) -> int:
    """XXH32 (seed 0) of ``b[i:i + n]`` for ``n < 16``: what an LZ4 frame's header checksum
    covers (its descriptor, 2 to 14 bytes). Arithmetic mod 2**32 in int64 (products wrap; their
    low 32 bits are right)."""
    h = (0x165667B1 + n) & _M32  # PRIME32_5 + len
    end = i + n
    while i + 4 <= end:
        h = (h + _u32(b, i) * 0xC2B2AE3D) & _M32
        h = (_rotl32(h, 17) * 0x27D4EB2F) & _M32
        i += 4
    while i < end:
        h = (h + np.int64(b[i]) * 0x165667B1) & _M32
        h = (_rotl32(h, 11) * 0x9E3779B1) & _M32
        i += 1
    h ^= h >> 15
    h = (h * 0x85EBCA77) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE3D) & _M32
    return h ^ (h >> 16)


@njit(cache=True, nogil=True)
def _frame(lz4: int, src: np.ndarray, ip: int, iend: int, dst: np.ndarray, op: int, oend: int) -> int:
    """Decode one LZ4 frame ``src[ip:iend]`` (exactly) into ``dst[op:oend]``; its end, or -1.

    Declines whatever liblz4's frame decoder (python-lz4's, the pure-Python way) refuses: a FLG
    or BD byte with a reserved bit set or an unknown block size, a header checksum that does not
    match, a content size with its top bit set, a block larger than the frame's block size."""
    if iend - ip < 7 or _u32(src, ip) != _FRAME_MAGIC:
        return -1
    flg = np.int64(src[ip + 4])
    bd = np.int64(src[ip + 5])
    if (flg >> 6) != 1 or flg & 0x17:  # version 01; no checksums, dictionary id, reserved bit
        return -1
    if bd & 0x8F or (bd >> 4) < 4:  # reserved bits; block size ids 4-7 (64 KiB to 4 MiB)
        return -1
    max_block = np.int64(1) << (2 * (bd >> 4) + 8)
    descriptor = 2
    size = -1
    if flg & 0x08:
        if iend - ip < 15:
            return -1
        if src[ip + 13] & 0x80:  # a content size past 2**63: no frame of ours (liblz4 fails it)
            return -1
        size = _u32(src, ip + 6) | (_u32(src, ip + 10) << 32)
        if size == 0:  # liblz4 reads 0 as "size unknown"
            size = -1
        descriptor = 10
    if (_xxh32_short(src, ip + 4, descriptor) >> 8) & 0xFF != src[ip + 4 + descriptor]:
        return -1  # the header checksum byte
    ip += 5 + descriptor
    ostart = op
    while True:
        if ip + 4 > iend:
            return -1
        bsize = _u32(src, ip)
        ip += 4
        if bsize == 0:
            break
        raw = bsize & 0x80000000
        bsize &= 0x7FFFFFFF
        if ip + bsize > iend or bsize > max_block:
            return -1
        if raw:
            if op + bsize > oend:
                return -1
            _copy(src, ip, dst, op, bsize)
            op += bsize
        else:
            base = op if flg & 0x20 else ostart
            bend = min(oend, op + max_block)  # a block decodes to at most the frame's block size
            if lz4:
                op = _c_block(lz4, src, ip, ip + bsize, dst, op, bend, base)
            else:
                op = _block(src, ip, ip + bsize, dst, op, bend, base)
            if op < 0:
                return -1
        ip += bsize
    if ip != iend or (size >= 0 and op - ostart != size):
        return -1
    return op


@intrinsic
def _put32(typingctx: Any, dst: Any, op: Any, value: Any) -> Any:
    """Store ``value``'s low 32 bits at ``dst[op:op + 4]`` (unaligned, little-endian host)."""
    sig = types.void(dst, op, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, o, v = args
        darr = context.make_array(signature.args[0])(context, builder, d)
        ptr = builder.bitcast(builder.gep(darr.data, [o]), ir.IntType(32).as_pointer())
        builder.store(builder.trunc(v, ir.IntType(32)), ptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _ungroup4(g: np.ndarray, n: int, dst: np.ndarray, op: int) -> None:
    """Undo byte grouping 4: ``g[:n]`` holds lanes k = 0..3 of ``dst[op:op + n]``, one after another."""
    q, r = n // 4, n % 4
    s1 = q + (1 if r > 0 else 0)
    s2 = s1 + q + (1 if r > 1 else 0)
    s3 = s2 + q + (1 if r > 2 else 0)
    g0, g1, g2, g3 = g[:q], g[s1 : s1 + q], g[s2 : s2 + q], g[s3 : s3 + q]
    for j in range(q):
        _put32(dst, op + 4 * j, np.uint32(g0[j]) | (np.uint32(g1[j]) << 8) | (np.uint32(g2[j]) << 16)
               | (np.uint32(g3[j]) << 24))
    o = op + 4 * q
    if r > 0:
        dst[o] = g[q]
    if r > 1:
        dst[o + 1] = g[s1 + q]
    if r > 2:
        dst[o + 2] = g[s2 + q]


_SIGNATURE = ("void(int64, uint8[::1], int64, int64, int64, uint8[::1], int64, int64, uint8[::1], int64, "
              "int64[::1])")


@njit(_SIGNATURE, cache=True, nogil=True)  # compiled (or loaded from the cache) at import
def decode_run(lz4: int, win: np.ndarray, start: int, end: int, chunks: int, out: np.ndarray, pos: int,
               limit: int, scratch: np.ndarray, max_chunk: int, info: np.ndarray) -> None:
    """Decode up to ``chunks`` consecutive chunks from ``win[start:end]`` into ``out[pos:limit]``,
    one after another. ``info`` gets (next start, chunks decoded, next pos, outcome, bytes
    needed). A chunk that fails leaves its bytes in ``out`` undefined (the caller re-decodes it
    the pure-Python way, which writes them again or raises)."""
    done = 0
    outcome = DONE
    need = 0
    while done < chunks:
        if end - start < 8:
            outcome, need = NEED, 8
            break
        clen = np.int64(win[start + 1]) | (np.int64(win[start + 2]) << 8) | (np.int64(win[start + 3]) << 16)
        scheme = np.int64(win[start + 4])
        ulen = np.int64(win[start + 5]) | (np.int64(win[start + 6]) << 8) | (np.int64(win[start + 7]) << 16)
        if win[start] != 0 or clen > max_chunk or ulen > max_chunk or scheme > 2:
            outcome = BAD_HEADER
            break
        if end - start < 8 + clen:
            outcome, need = NEED, 8 + clen
            break
        if ulen > limit - pos:
            outcome = NO_ROOM
            break
        p = start + 8
        if scheme == 0:
            if clen != ulen:
                outcome = BAD_PAYLOAD
                break
            _copy(win, p, out, pos, ulen)
        elif scheme == 1:
            if _frame(lz4, win, p, p + clen, out, pos, pos + ulen) != pos + ulen:
                outcome = BAD_PAYLOAD
                break
        else:
            if _frame(lz4, win, p, p + clen, scratch, 0, ulen) != ulen:
                outcome = BAD_PAYLOAD
                break
            _ungroup4(scratch, ulen, out, pos)
        pos += ulen
        start = p + clen
        done += 1
    info[0] = start
    info[1] = done
    info[2] = pos
    info[3] = outcome
    info[4] = need


__all__ = ["BAD_HEADER", "BAD_PAYLOAD", "DONE", "NEED", "NO_ROOM", "decode_run"]
