"""LocalDiskBackend: chunks as files in a local directory, bounded by bytes, LRU.

Files are written by :class:`~kvbucket.stores.local.file.FileStore` (temp file + rename), so a crash
mid-write never leaves a partial chunk under a key, and sealed (:mod:`kvbucket.stores.guard.sealed`):
every load is verified before the caller gets it. The index is rebuilt from the directory at
start (oldest modification first in the LRU order), checking each file's envelope header
against its size, so a truncated or damaged file is dropped instead of served: a restart loses
nothing that was acknowledged and serves nothing that was not. A file that is intact but not for
this tier (another model identity, keyring or key, encryption turned on or off, another name,
an envelope format it does not read) is never served and never deleted by a read
(docs/integrity.md, "What a reader may delete"): it counts in the byte bound and is the first
evicted when room is needed. Files are 0600 and directories 0700 because KV caches hold users'
prompts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvbucket.backends._putqueue import PutQueue
from kvbucket.backends._queued import BoundedLocalTier
from kvbucket.backends.base import Chunk, Key, check_buffers
from kvbucket.errors import ConfigError, InvalidKeyError, NoSpaceError
from kvbucket.identity.core import IdentitySetting, qualify_key_string, split_key_string
from kvbucket.keys import as_key_string, key_to_name, name_to_key
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import ObjectInfo, ObjectStore
from kvbucket.stores.guard.refusals import removable
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.file import FileStore

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count
_STRIPES = 64
#: files to delete after an eviction: (the chunk's key, None for a file not for this tier; its name)
Victims = list[tuple[str | None, str]]
LOCK_NAME = ".kvbucket-disk.lock"


class LocalDiskBackend(BoundedLocalTier):
    """Chunk files under ``path`` (or any store given), at most ``max_bytes`` accounted.

    Space is reserved (evicting least-recently-used chunks) *before* a file is written, so the
    accounted bytes never exceed ``max_bytes``; the evicted files are deleted right after, so the
    directory can exceed the bound by at most the chunks being written at that moment.
    Operations on one key are serialised by a striped lock, so an eviction can never delete a
    file that a concurrent put of the same key just wrote. A directory serves one backend at a
    time (a lock file, released by ``close()`` or by the process ending).
    """

    _TIER_NAME = "disk"
    _SIZE_SETTING = "max_local_disk_size"

    def __init__(
        self,
        path: str | os.PathLike[str] | ObjectStore,
        max_bytes: int,
        *,
        fsync: bool = False,
        queue_size: int = 16,
        on_evict: Callable[[str], None] | None = None,
        encryption: Any = None,
        model_identity: str | dict[str, str] | None = None,
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"LocalDiskBackend needs a positive max_bytes, got {max_bytes!r}")
        raw = path if isinstance(path, ObjectStore) else FileStore(path, fsync=fsync)
        # A refused file is removed only when damaged; one not for this tier stays (in _foreign).
        self.store = seal_store(raw, tier="disk", encryption=encryption)
        self._dir_lock = self._lock_directory()
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._on_evict = on_evict
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, LRU first
        # Names carry the model's identity (kvbucket.identity), as the remote tier's do: after a
        # redeploy with other weights, the directory's chunks of the old identity are not served.
        self._identity = IdentitySetting(model_identity)
        # Its index is by identity: the first time a model directory's weights are hashed on this
        # machine (kvbucket.identity.weights), the tier waits for it here, before any use.
        self._identity.wait()
        # Files this tier does not serve but that are intact (file name -> bytes, oldest first):
        # in the byte bound, evicted first.
        self._foreign: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        try:
            self._rebuild_index()
        except BaseException:
            if self._dir_lock is not None:
                os.close(self._dir_lock)
            raise
        self.skipped_full = 0  # chunks this tier skipped because the filesystem was full
        self._full_logged = False
        self._queue = PutQueue("disk", self._apply_queued, queue_size)
        self._closed = False

    def __repr__(self) -> str:
        return f"LocalDiskBackend({self.store.url!r}, max_bytes={self.max_bytes})"

    # ---- interface -----------------------------------------------------------------------
    def get(self, key: Key) -> Chunk | None:
        k = as_key_string(key)
        pending = self._queue.pending(k)
        if pending is not None:
            return pending.toreadonly()
        with self._lock:
            size = self._index.get(k)
            if size is None:
                return None
            self._index.move_to_end(k)
        buf = np.empty(size, dtype=np.uint8)
        (r,) = self.store.get_many([self._name(k)], [buf])
        if r.error is not None or r.size is None:
            # removed or evicted (or replaced by a chunk of another size) since we looked
            if r.error is not None:
                log.debug("disk tier read of %s failed: %s", k, r.error)
            else:
                self._forget_if_gone(k)
            return None
        return memoryview(buf).toreadonly()

    def batched_get_into(self, keys: Sequence[Key], buffers: Sequence[Chunk]) -> list[bool]:
        check_buffers(keys, buffers)
        ks = [as_key_string(k) for k in keys]
        out, rest = self._copy_pending_into(ks, buffers)
        todo: list[int] = []
        for i in rest:
            with self._lock:
                if ks[i] in self._index:
                    self._index.move_to_end(ks[i])
                    todo.append(i)
        if todo:
            results = self.store.get_many([self._name(ks[i]) for i in todo], [buffers[i] for i in todo])
            for i, r in zip(todo, results, strict=True):
                if r.error is not None:
                    _repeated.warning("disk tier read of %s into the caller's buffer failed: %s", ks[i],
                                      r.error, item=ks[i])
                elif r.size is None:
                    self._forget_if_gone(ks[i])
                out[i] = r.found
        return out

    def _forget_if_gone(self, key: str) -> None:
        """After a load found nothing it could serve: drop the index entry of a file deleted behind
        our back (not by us: we unindex first) or removed as damaged; a file still there was
        refused and kept (not for this tier): no longer served, and evicted first."""
        with self._stripe(key):
            (h,) = self.store.head_many([self._name(key)])
            if h.error is None:
                with self._lock:
                    size = self._index.pop(key, None)
                    if size is None:
                        return
                    if h.size is None:
                        self.used_bytes -= size
                        log.info("disk tier: the file of %s is gone (removed outside kvbucket, or refused by "
                                 "the integrity check); forgotten", key)
                    else:
                        self._foreign[self._name(key)] = size  # still counted in used_bytes

    def contains(self, key: Key) -> bool:
        k = as_key_string(key)
        with self._lock:
            if k in self._index:
                return True
        return self._queue.pending(k) is not None

    def remove(self, key: Key) -> bool:
        k = as_key_string(key)
        dropped = self._queue.cancel(k)
        with self._stripe(k):
            with self._lock:
                size = self._index.pop(k, None)
                foreign = self._foreign.pop(self._name(k), None)
                self.used_bytes -= (size or 0) + (foreign or 0)
            if size is not None or foreign is not None:
                self.store.delete_many([self._name(k)])
        return dropped or size is not None

    def list(self) -> list[str]:
        with self._lock:
            keys = list(self._index)
        return self._with_pending(keys)

    # ---- internals -----------------------------------------------------------------------
    def _release(self) -> None:
        self.store.close()
        if self._dir_lock is not None:
            os.close(self._dir_lock)  # releases the flock

    def _stripe(self, key: str) -> threading.Lock:
        return self._stripes[zlib.crc32(key.encode()) % _STRIPES]

    def _apply(self, key: str, view: memoryview) -> None:
        self._write(key, view)

    def _apply_queued(self, key: str, view: memoryview) -> None:
        with contextlib.suppress(NoSpaceError):  # skipped: counted and logged once by _write
            self._write(key, view)

    def _write(self, key: str, view: memoryview) -> None:
        """Store one chunk; on a full filesystem evict to make room and retry once, else skip.

        The old file of ``key`` (if any) is never deleted before the new one is in place: the
        store writes a temp file and renames it, so a failed write leaves the old copy, which
        is indexed again. A write that still finds no space after evicting raises
        :class:`NoSpaceError` (counted in ``skipped_full``, logged once per full episode).
        """
        n = view.nbytes
        failure, victims = self._try_write(key, view, n)
        self._delete_victims(victims)  # outside the stripe: victims may share it
        if isinstance(failure, NoSpaceError):
            # The byte bound said there was room, the filesystem disagrees (it is smaller than
            # max_bytes, or shared). Free at least this chunk's size more, then retry once.
            self._delete_victims(self._evict_bytes(n, keep=key))
            failure, victims = self._try_write(key, view, n)
            self._delete_victims(victims)
            if isinstance(failure, NoSpaceError):
                from kvbucket.metrics import DISK_SKIPPED_FULL  # not at import: metrics imports backends

                self.skipped_full += 1
                DISK_SKIPPED_FULL.labels(self.store.url).inc()  # shown by `kvbucket stats`
                if not self._full_logged:
                    self._full_logged = True
                    log.warning(
                        "disk tier %s: the filesystem is full even after evicting; chunks are skipped "
                        "by this tier until space frees up (the other tiers still store them): %s",
                        self.store.url, failure,
                    )
                raise failure
        if failure is not None:
            raise failure
        self._full_logged = False

    def _try_write(self, key: str, view: memoryview, n: int) -> tuple[BaseException | None, Victims]:
        """One attempt: reserve ``n`` bytes (choosing LRU victims), write; (failure, victims)."""
        victims: Victims = []
        with self._stripe(key):
            with self._lock:
                old = (self._index.pop(key, None) or 0) + (self._foreign.pop(self._name(key), None) or 0)
                self.used_bytes -= old  # the new file replaces the old one (served or foreign)
                while (self._foreign or self._index) and self.used_bytes + n > self.max_bytes:
                    victims.append(self._pop_victim())
                self.used_bytes += n  # reserved before writing: the bound holds at every moment
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            try:
                (r,) = self.store.put_many([(self._name(key), view)])
                if r.error is not None:
                    raise r.error
            except BaseException as e:
                with self._lock:
                    self.used_bytes -= n
                self._reindex_after_failure(key)
                return e, victims
            with self._lock:
                self._index[key] = n
        return None, victims

    def _reindex_after_failure(self, key: str) -> None:
        """After a failed write the file under ``key`` is the old copy (the store renames a
        complete temp file into place, or nothing): keep it indexed, so a failed re-put never
        loses a good chunk. Called under the key's stripe."""
        with contextlib.suppress(Exception):
            (h,) = self.store.head_many([self._name(key)])
            if h.error is None and h.size is not None:
                with self._lock:
                    if key not in self._index:
                        self._index[key] = h.size
                        self.used_bytes += h.size

    def _pop_victim(self, *, count: bool = True) -> tuple[str | None, str]:
        """Unindex the next file to evict (lock held): one not for this tier first, else the LRU
        chunk. (its key, None for a foreign file; its file name)"""
        if self._foreign:
            name, size = self._foreign.popitem(last=False)
            vkey: str | None = None
        else:
            vkey, size = self._index.popitem(last=False)
            name = self._name(vkey)
        self.used_bytes -= size
        self.evictions += count
        return vkey, name

    def _evict_bytes(self, n: int, keep: str) -> Victims:
        """Unindex least-recently-used chunks holding at least ``n`` bytes (to be deleted), never
        ``keep``: the old copy of the chunk being written stays until the new one is in place.
        Files not for this tier go first."""
        victims: Victims = []
        with self._lock:
            target = self.used_bytes - n
            while self._foreign and self.used_bytes > target:
                victims.append(self._pop_victim())
            for vkey in list(self._index):
                if self.used_bytes <= target:
                    break
                if vkey == keep:
                    continue
                self._index.move_to_end(vkey, last=False)
                victims.append(self._pop_victim())
        return victims

    def _delete_victims(self, victims: Victims) -> None:
        for vkey, name in victims:
            guard = vkey if vkey is not None else self._chunk_key(name)
            with self._stripe(guard or name):
                with self._lock:
                    if guard is not None and guard in self._index and self._name(guard) == name:
                        continue  # (re-)put meanwhile: its new file is live
                self.store.delete_many([name])
            if vkey is not None and self._on_evict is not None:
                self._on_evict(vkey)

    def _chunk_key(self, name: str) -> str | None:
        """The key this tier would store under ``name``, if any (a foreign file's name may be one)."""
        try:
            return self._key_of(name)
        except InvalidKeyError:
            return None

    def _lock_directory(self) -> int | None:
        """One disk tier per directory: two indexes over one directory would break the byte bound
        and evict each other's files, so a second user gets a clear error instead.

        The lock is an ``flock`` on a file opened with ``O_NOFOLLOW``: a symlink planted under
        the lock's name is refused, never followed to create or lock a file outside the tier.
        Returns the fd holding the lock (closing it releases the lock).
        """
        if not isinstance(self.store.inner, FileStore):
            return None
        path = os.path.join(self.store.inner.root, LOCK_NAME)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise ConfigError(
                f"cannot open the disk tier's lock file {path!r}: {e.strerror} (a symlink there is "
                "refused; remove it)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"the disk tier directory {str(self.store.inner.root)!r} is in use by another "
                "LocalDiskBackend "
                "(this or another process); give each engine process its own local_disk directory"
            ) from None
        return fd

    def _name(self, key: str) -> str:
        if self._identity:
            key = qualify_key_string(key, self._identity.token(key.partition("@")[0]))
        return key_to_name(key)

    def _key_of(self, name: str) -> str:
        key = name_to_key(name)
        return split_key_string(key)[0] if self._identity else key

    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        infos = []
        foreign: list[tuple[float, str, int]] = []  # (mtime, file name, bytes) of files not served
        over = self.store.overhead
        for info in self.store.inner.list():
            try:
                key, token = split_key_string(name_to_key(info.name))
            except InvalidKeyError:
                continue  # not a chunk file kvbucket wrote
            mine = self._identity.token(key.partition("@")[0]) if self._identity else None
            if token != mine and (self._identity or token is None):  # another model identity's
                foreign.append((info.mtime or 0.0, info.name, max(0, info.size - over)))
                continue
            infos.append(info)
        # A file without a whole envelope header, or whose size disagrees with its header (cut
        # short by a crash or by hand), is removed here rather than indexed and served.
        listed = [ObjectInfo(i.name, i.size - over, i.mtime) for i in infos if i.size >= over]
        short = [i.name for i in infos if i.size < over]
        if short:
            self.store.refuse_names([(n, "truncated") for n in short])
        for info, reason in zip(listed, self.store.check_headers(listed), strict=True):
            if reason is None:
                found.append((info.mtime or 0.0, self._key_of(info.name), info.size))
            elif not removable(reason):  # intact, not for this tier: kept (and counted), never served
                foreign.append((info.mtime or 0.0, info.name, info.size))
        if foreign:
            log.info("disk tier %s: %d files not for this tier (another model identity, keyring or format) "
                     "kept, never served, evicted first", self.store.url, len(foreign))
        for _, name, size in sorted(foreign):
            self._foreign[name] = size
            self.used_bytes += size
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self.used_bytes += size
        evicted = []
        while self.used_bytes > self.max_bytes and (self._foreign or self._index):  # the bound was lowered
            evicted.append(self._pop_victim(count=False)[1])
        if evicted:
            self.store.delete_many(evicted)
            log.info("disk tier %s: evicted %d chunks to fit max_bytes=%d", self.store.url, len(evicted),
                     self.max_bytes)
        self.peak_bytes = self.used_bytes
        if found:
            log.info("disk tier %s: recovered %d chunks (%d bytes)", self.store.url, len(self._index),
                     self.used_bytes)
