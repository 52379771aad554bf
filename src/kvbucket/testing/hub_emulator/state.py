"""Persistent emulator state: buckets, files, file reconstructions and xorbs under one data dir.

Metadata lives in SQLite (atomic commits, durable across crashes and restarts); xorb bodies are
plain files written to a temp name, fsynced, then ``os.replace``d, so a crash never leaves a
half-written xorb under its final name. Xorb files are served to clients as byte ranges as is.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import errno
import functools
import json
import os
import sqlite3
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rwlock import SharedExclusive
from .xet import EMPTY_FILE_HASH_HEX, FileRecord, Segment, XorbIndex

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
    id TEXT PRIMARY KEY, private INTEGER NOT NULL, created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    bucket TEXT NOT NULL, path TEXT NOT NULL, xet_hash TEXT NOT NULL, size INTEGER NOT NULL,
    mtime INTEGER NOT NULL, uploaded_at TEXT NOT NULL, content_type TEXT,
    PRIMARY KEY (bucket, path)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS files_by_hash ON files (xet_hash, bucket);
CREATE TABLE IF NOT EXISTS xorbs (
    hash TEXT PRIMARY KEY, offsets BLOB NOT NULL, lens BLOB NOT NULL, chunk_hashes BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS uploads (
    file_hash TEXT NOT NULL, bucket TEXT NOT NULL, PRIMARY KEY (file_hash, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reconstructions (
    file_hash TEXT PRIMARY KEY, size INTEGER NOT NULL, segments TEXT NOT NULL
) WITHOUT ROWID;
"""


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@functools.lru_cache(maxsize=65536)  # a batch shares one mtime; listings repeat them
def ms_to_iso(ms: int) -> str:
    when = dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class BucketRow:
    id: str
    private: bool
    created_at: str


@dataclass(frozen=True)
class FileRow:
    path: str
    xet_hash: str
    size: int
    mtime: int
    uploaded_at: str
    content_type: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "type": "file",
            "path": self.path,
            "size": self.size,
            "xetHash": self.xet_hash,
            "mtime": ms_to_iso(self.mtime),
            "uploadedAt": self.uploaded_at,
        }


def preallocate(fd: int, size: int) -> None:
    """Reserve a new file's blocks before writing it; best effort.

    Why: written page by page into an empty ext4 file, every block goes through delayed
    allocation when it is written and again at fsync. With the extent allocated up front, a
    64 MiB xorb costs a third to a quarter of the CPU to store (measured on ext4: buffered write
    + fsync 0.7-1.3 s/GiB without, 0.28 s/GiB with). The file's size is ``size`` from here on,
    so callers write it completely or delete it. (On a file system without ``fallocate``, glibc
    emulates it by touching each block: slower there, never wrong.)
    """
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if is_disk_full(e):  # a full disk: say so before any byte is written
            raise
        # a file system without fallocate: write as before


#: Bytes received between two writeback starts (see ``Writeback``).
WRITEBACK_STEP = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, no wait


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux; ``os`` has no binding), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` of ``fd`` to disk; best effort.

    Durability still comes from the fsync before a xorb is acknowledged; this only moves the
    disk's work earlier. Left alone, a received xorb's 64 MiB stay dirty in the page cache until
    that fsync, so the disk starts only once the body is in and verified (on this project's
    2-core VM, two 64 MiB files fsynced after 0.1 s of other work: 0.34-0.35 s, and 0.27-0.28 s
    when their writeback had been started every 8 MiB as they were written).
    """
    fn = _sync_file_range()
    if fn is not None and length > 0:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure only means no head start


class Writeback:
    """Starts the disk writes of a file being filled front to back, every ``WRITEBACK_STEP`` bytes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0  # bytes written so far, from offset 0
        self.started = 0  # bytes whose writeback was started

    def wrote(self, n: int) -> None:
        self.written += n
        if self.written - self.started >= WRITEBACK_STEP:
            start_writeback(self.fd, self.started, self.written - self.started)
            self.started = self.written


def write_all(fd: int, data: bytes | bytearray | memoryview, writeback: Writeback | None = None) -> None:
    """Write all of ``data``; with ``writeback``, its disk writes start every step on the way."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view[:WRITEBACK_STEP] if writeback is not None else view)
        if writeback is not None:
            writeback.wrote(n)
        view = view[n:]


def fsync_file(path: str) -> None:
    """Make the bytes written to ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(exc: BaseException) -> bool:
    """Did ``exc`` come from a full disk (or quota), in a file write or in SQLite?"""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == getattr(sqlite3, "SQLITE_FULL", 13) or "disk is full" in str(exc)
    return False


def _pack(values: Iterable[int]) -> bytes:
    vals = list(values)
    return struct.pack(f"<{len(vals)}Q", *vals)


def _unpack(blob: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(blob) // 8}Q", blob))


class State:
    """All of the emulator's durable data. Thread-safe (one lock around the SQLite connection)."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.root = Path(data_dir)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.xorb_dir = self.root / "xorbs"
        self.xorb_dir.mkdir(exist_ok=True, mode=0o700)
        self._lock = threading.RLock()
        db_path = self.root / "index.sqlite3"
        os.close(os.open(db_path, os.O_CREAT | os.O_RDWR, 0o600))  # user data: owner-only (WAL inherits)
        self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._xorb_cache: dict[str, XorbIndex] = {}
        # held shared by xorb stores and shard acceptance, exclusively by a collection batch
        # (``xorb_gc``): a xorb is never dropped between an upload's look at it and its use
        self.xorb_guard = SharedExclusive()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Apply many small writes (a batch request) in one commit: one fsync, not one per line."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- buckets ---------------------------------------------------------------------------
    def create_bucket(self, bucket_id: str, private: bool) -> bool:
        """Create; False if it already existed (state unchanged)."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO buckets (id, private, created_at) VALUES (?, ?, ?)",
                (bucket_id, int(private), now_iso()),
            )
            return cur.rowcount == 1

    def get_bucket(self, bucket_id: str) -> BucketRow | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, private, created_at FROM buckets WHERE id = ?", (bucket_id,)
            ).fetchone()
        return BucketRow(row[0], bool(row[1]), row[2]) if row else None

    def list_buckets(self, namespace: str) -> list[BucketRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, private, created_at FROM buckets WHERE id >= ? AND id < ? ORDER BY id",
                (namespace + "/", namespace + "0"),
            ).fetchall()
        return [BucketRow(r[0], bool(r[1]), r[2]) for r in rows]

    def bucket_usage(self, bucket_id: str) -> tuple[int, int]:
        with self._lock:
            n, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM files WHERE bucket = ?", (bucket_id,)
            ).fetchone()
        return int(n), int(size)

    def set_private(self, bucket_id: str, private: bool) -> None:
        with self._lock:
            self._db.execute("UPDATE buckets SET private = ? WHERE id = ?", (int(private), bucket_id))

    def delete_bucket(self, bucket_id: str) -> None:
        """Drop the bucket and its file entries (xorbs stay: they may be shared, as on the Hub)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM files WHERE bucket = ?", (bucket_id,))
            self._db.execute("DELETE FROM uploads WHERE bucket = ?", (bucket_id,))
            self._db.execute("DELETE FROM buckets WHERE id = ?", (bucket_id,))
            self._db.execute("COMMIT")

    def move_bucket(self, src: str, dst: str) -> bool:
        """Rename a bucket with its files; False if ``dst`` exists already."""
        with self.transaction():
            if self._db.execute("SELECT 1 FROM buckets WHERE id = ?", (dst,)).fetchone():
                return False
            self._db.execute("UPDATE buckets SET id = ? WHERE id = ?", (dst, src))
            self._db.execute("UPDATE files SET bucket = ? WHERE bucket = ?", (dst, src))
            self._db.execute("UPDATE uploads SET bucket = ? WHERE bucket = ?", (dst, src))
        return True

    # -- files -----------------------------------------------------------------------------
    def _file_row(self, r: tuple) -> FileRow:  # type: ignore[type-arg]
        return FileRow(r[0], r[1], int(r[2]), int(r[3]), r[4], r[5])

    _FILE_COLS = "path, xet_hash, size, mtime, uploaded_at, content_type"

    def get_files(self, bucket_id: str, paths: list[str]) -> list[FileRow]:
        """The rows of ``paths`` that exist, in the order asked (one query, whatever the count)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT f.path, f.xet_hash, f.size, f.mtime, f.uploaded_at, f.content_type"
                " FROM json_each(?) AS p JOIN files AS f ON f.bucket = ? AND f.path = p.value ORDER BY p.key",
                (json.dumps(paths), bucket_id),
            ).fetchall()
        return [self._file_row(r) for r in rows]

    def iter_files(self, bucket_id: str, prefix: str, after: str | None = None) -> Iterator[FileRow]:
        """Files whose path starts with ``prefix`` (lexically, as the Hub does), in path order."""
        lo = prefix if after is None or after < prefix else after
        op = ">=" if after is None or after < prefix else ">"
        batch = 1000
        while True:
            with self._lock:
                rows = self._db.execute(
                    f"SELECT {self._FILE_COLS} FROM files WHERE bucket = ? AND path {op} ? "
                    "ORDER BY path LIMIT ?",
                    (bucket_id, lo, batch),
                ).fetchall()
            for r in rows:
                if not r[0].startswith(prefix):
                    return
                yield self._file_row(r)
            if len(rows) < batch:
                return
            lo, op = rows[-1][0], ">"

    def put_file(self, bucket_id: str, row: FileRow) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO files (bucket, path, xet_hash, size, mtime, uploaded_at,"
                " content_type) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (bucket_id, row.path, row.xet_hash, row.size, row.mtime, row.uploaded_at, row.content_type),
            )

    def delete_file(self, bucket_id: str, path: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE bucket = ? AND path = ?", (bucket_id, path))
            return cur.rowcount == 1

    def bucket_has_hash(self, bucket_id: str, xet_hash: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM files WHERE xet_hash = ? AND bucket = ? LIMIT 1", (xet_hash, bucket_id)
            ).fetchone()
        return row is not None

    def buckets_reaching(self, xet_hash: str) -> list[str]:
        """The buckets through which ``xet_hash`` was uploaded or is held: who may add it by hash.

        Why: the CAS is shared by all users, so knowing a file's hash must not be a way to read
        it. An ``addFile`` by hash is for content the caller uploaded, or can already read.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT bucket FROM uploads WHERE file_hash = ?"
                " UNION SELECT bucket FROM files WHERE xet_hash = ?",
                (xet_hash, xet_hash),
            ).fetchall()
        return [r[0] for r in rows]

    # -- reconstructions -------------------------------------------------------------------
    def put_reconstructions(self, records: list[FileRecord], bucket_id: str) -> None:
        """Store the files of an accepted shard, uploaded with a Xet write token of ``bucket_id``."""
        with self._lock:
            self._db.execute("BEGIN")
            for rec in records:
                self._db.execute(
                    "INSERT OR IGNORE INTO uploads (file_hash, bucket) VALUES (?, ?)",
                    (rec.hash_hex, bucket_id),
                )
                segs = [[s.xorb_hex, s.unpacked_bytes, s.chunk_start, s.chunk_end] for s in rec.segments]
                self._db.execute(
                    "INSERT OR REPLACE INTO reconstructions (file_hash, size, segments) VALUES (?, ?, ?)",
                    (rec.hash_hex, rec.size, json.dumps(segs)),
                )
            self._db.execute("COMMIT")

    def get_reconstruction(self, file_hash: str) -> FileRecord | None:
        if file_hash == EMPTY_FILE_HASH_HEX:
            return FileRecord(file_hash, [])
        with self._lock:
            row = self._db.execute(
                "SELECT segments FROM reconstructions WHERE file_hash = ?", (file_hash,)
            ).fetchone()
        if row is None:
            return None
        return FileRecord(file_hash, [Segment(*s) for s in json.loads(row[0])])

    # -- xorbs -----------------------------------------------------------------------------
    def sweep_temps(self, older_than_s: float, paths: Iterable[Path] | None = None
                    ) -> tuple[int, int, list[Path]]:
        """Remove xorb temp files (``.tmp-*`` under ``xorbs``, or ``paths``) not written for
        ``older_than_s``: left by a server killed mid-upload (SIGKILL runs no cleanup), each
        preallocated to its xorb's full size. A live upload writes its file as bytes come and
        renames or removes it within its body timeout and a verification, so an old file has no
        writer; a younger one is returned, to be looked at again once it is old enough.
        Returns (files removed, bytes freed, younger temp files)."""
        now = time.time()
        removed = freed = 0
        young: list[Path] = []
        for path in self.xorb_dir.rglob(".tmp-*") if paths is None else paths:
            try:
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                if now - st.st_mtime < older_than_s:
                    young.append(path)
                    continue
                path.unlink()
            except OSError:  # renamed or removed by its writer meanwhile, or not ours to remove
                continue
            removed += 1
            freed += st.st_blocks * 512
        return removed, freed, young

    def xorb_path(self, xorb_hex: str) -> Path:
        return self.xorb_dir / xorb_hex[:2] / xorb_hex

    def has_xorb(self, xorb_hex: str) -> bool:
        return self.get_xorb(xorb_hex) is not None

    def get_xorb(self, xorb_hex: str) -> XorbIndex | None:
        idx = self._xorb_cache.get(xorb_hex)
        if idx is not None:
            return idx
        with self._lock:
            row = self._db.execute(
                "SELECT offsets, lens, chunk_hashes FROM xorbs WHERE hash = ?", (xorb_hex,)
            ).fetchone()
        if row is None:
            return None
        hashes = [row[2][i : i + 32] for i in range(0, len(row[2]), 32)]
        idx = XorbIndex(xorb_hex, _unpack(row[0]), _unpack(row[1]), hashes)
        if len(self._xorb_cache) > 4096:
            self._xorb_cache.clear()
        self._xorb_cache[xorb_hex] = idx
        return idx

    def touch_xorb(self, xorb_hex: str) -> bool:
        """Mark a stored xorb used now (its file's mtime: what collection's grace counts from);
        False if it is not stored. Call under ``xorb_guard.shared()``."""
        if not self.has_xorb(xorb_hex):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.xorb_path(xorb_hex))
        return True

    def xorb_known(self, xorb_hex: str) -> bool:
        """``touch_xorb`` under the guard: an upload deduped against this xorb uses it."""
        with self.xorb_guard.shared():
            return self.touch_xorb(xorb_hex)

    def put_xorb_file(self, idx: XorbIndex, tmp: str, synced: bool = False) -> bool:
        """Store a verified xorb already written to ``tmp`` (in ``xorb_dir``): fsync (unless
        ``synced``: the caller fsynced it, see ``fsync_file``), rename, index."""
        if not synced:
            fsync_file(tmp)
        with self.xorb_guard.shared():
            if self.touch_xorb(idx.hash_hex):
                Path(tmp).unlink(missing_ok=True)
                return False
            final = self.xorb_path(idx.hash_hex)
            final.parent.mkdir(exist_ok=True, mode=0o700)
            os.replace(tmp, final)
            return self._index_xorb(idx)

    def _index_xorb(self, idx: XorbIndex) -> bool:
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO xorbs (hash, offsets, lens, chunk_hashes) VALUES (?, ?, ?, ?)",
                (idx.hash_hex, _pack(idx.byte_offsets), _pack(idx.unpacked_lens), b"".join(idx.chunk_hashes)),
            )
        return cur.rowcount == 1

    def put_xorb(self, idx: XorbIndex, data: bytes | bytearray) -> bool:
        """Store a verified xorb; False if it was already there. Body first, then the index row."""
        if self.xorb_known(idx.hash_hex):
            return False
        final = self.xorb_path(idx.hash_hex)
        final.parent.mkdir(exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        try:
            try:
                preallocate(fd, len(data))
                write_all(fd, data, Writeback(fd))
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.put_xorb_file(idx, tmp, synced=True)
