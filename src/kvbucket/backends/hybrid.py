"""HybridBackend: tiers in front of each other (local_cpu -> local_disk -> remote(s)).

Write-through: a put goes to every tier, so the slowest (most durable) tier always has what
was acknowledged. Read-through: a get asks the tiers in order and a hit in a lower tier is
promoted into every faster tier that missed, so the next read is served from memory.
A hit is also told to the slower tiers that take hints (``note_accessed(keys)``, duck-typed so
wrappers such as ``InstrumentedBackend`` pass it on): a remote tier in a fleet then knows the
chunk is in use although the engine reads it from memory.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbucket.backends.base import (
    DEFAULT_FLUSH_TIMEOUT_SECS,
    Chunk,
    FlushResult,
    Key,
    StorageBackend,
    check_buffers,
    check_open,
    put_as_batch,
)
from kvbucket.chunks import as_view
from kvbucket.errors import CircuitOpenError, KVBucketError, NoSpaceError, StoreError
from kvbucket.keys import as_key_string
from kvbucket.log_once import RepeatedLog, flush_all
from kvbucket.threads import DaemonThreadPool

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count
_STRIPES = 256


def _status(tier: StorageBackend) -> dict[str, Any]:
    report = getattr(tier, "report_status", None)
    return report() if report is not None else {"tier": type(tier).__name__}


class TierPutError(KVBucketError):
    """A write-through put failed in some tiers (the message names them and why)."""


class HybridBackend(StorageBackend):
    """Tiers fastest first. A chunk counts as stored only when every tier took it, except that
    a local tier whose filesystem is full may skip it (:class:`NoSpaceError`, counted in
    ``tier_skips``) when another tier stored it: a full disk never fails a put.

    With ``parallel_writes`` (the default) a put writes all tiers at the same time, so a
    disk write overlaps the upload; the put returns when every tier has answered.
    ``promote_blocking`` chooses whether promotions into faster tiers wait (the default,
    so a read is followed by a memory hit) or go through the tiers' non-blocking queues.

    A promotion never overwrites a newer write: every put and remove bumps a (striped) write
    generation when it starts and when it ends, and a promotion is applied, under the stripe's
    lock, only if no write is in progress and the generation is the one seen before the read,
    and only into tiers that do not hold the key (a queued non-blocking put is newer). Without
    this, a read that fetched an old version from the remote tier could put it back into
    memory after a concurrent put of a new version had landed there.
    """

    def __init__(
        self, tiers: Sequence[StorageBackend], *, promote_blocking: bool = True, parallel_writes: bool = True
    ) -> None:
        if not tiers:
            raise ValueError("HybridBackend needs at least one tier")
        self.tiers = list(tiers)
        self.promote_blocking = promote_blocking
        self.hits = [0] * len(self.tiers)  # per tier, for the demo's summary and tuning
        self.misses = 0
        self.promotion_failures = 0
        self.promotions_skipped = 0  # a write of the key raced the read; its data is newer
        self.tier_skips = [0] * len(self.tiers)  # chunks a full tier skipped (others stored them)
        self.lookup_failures = [0] * len(self.tiers)  # keys a failing tier answered as misses
        self._gen = [0] * _STRIPES
        self._writing = [0] * _STRIPES
        self._gen_locks = [threading.Lock() for _ in range(_STRIPES)]
        self._closed = False
        self._writers = (
            # threads start lazily; enough for several callers putting at once
            DaemonThreadPool(8 * (len(self.tiers) - 1), "kvbucket-hybrid-put")
            if parallel_writes and len(self.tiers) > 1 else None
        )

    def __repr__(self) -> str:
        return f"HybridBackend({self.tiers!r})"

    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        put_as_batch(self, key, chunk, blocking)

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        check_open(self, self._closed)
        items = list(items)
        names = [as_key_string(k) for k, _ in items]
        failures: list[list[str]] = [[] for _ in items]
        self._begin_writes(names)
        try:
            if self._writers is None or len(self.tiers) == 1:
                per_tier = [tier.batched_put_results(items, blocking=blocking) for tier in self.tiers]
            else:  # the tiers write at the same time: the disk write overlaps the upload
                futures = [self._writers.submit(tier.batched_put_results, items, blocking)
                           for tier in self.tiers[1:]]
                per_tier = [self.tiers[0].batched_put_results(items, blocking=blocking)]  # in this thread
                per_tier += [f.result() for f in futures]
            for t, (tier, results) in enumerate(zip(self.tiers, per_tier, strict=True)):
                for i, err in enumerate(results):
                    if err is None:
                        continue
                    if isinstance(err, NoSpaceError) and any(r[i] is None for r in per_tier):
                        self.tier_skips[t] += 1  # a full local tier: the others have the chunk
                        continue
                    failures[i].append(f"{type(tier).__name__}: {err}")
        finally:
            self._end_writes(names)
        out: list[Exception | None] = []
        for (key, _), fails in zip(items, failures, strict=True):
            if not fails:
                out.append(None)
            else:
                out.append(TierPutError(
                    f"{as_key_string(key)}: {len(fails)} of {len(self.tiers)} tiers refused it: "
                    + "; ".join(fails)
                ))
        return out

    def get(self, key: Key) -> Chunk | None:
        return self.batched_get([key])[0]

    def batched_get(self, keys: Sequence[Key]) -> list[Chunk | None]:
        ks = [as_key_string(k) for k in keys]
        return self._read_through(ks, lambda tier, idx: tier.batched_get([ks[i] for i in idx]), lambda c: c)

    def batched_get_into(self, keys: Sequence[Key], buffers: Sequence[Chunk]) -> list[bool]:
        check_buffers(keys, buffers)
        ks = [as_key_string(k) for k in keys]

        def read(tier: StorageBackend, idx: list[int]) -> list[Chunk | None]:
            hits = tier.batched_get_into([ks[i] for i in idx], [buffers[i] for i in idx])
            return [buffers[i] if hit else None for i, hit in zip(idx, hits, strict=True)]

        def promoted(buf: Chunk) -> Chunk:
            # the caller owns the buffer: promote a copy unless promotion is synchronous
            return buf if self.promote_blocking else as_view(buf).tobytes()

        return [c is not None for c in self._read_through(ks, read, promoted)]

    def _read_through(
        self,
        ks: list[str],
        read: Callable[[StorageBackend, list[int]], list[Chunk | None]],
        promoted: Callable[[Chunk], Chunk],
    ) -> list[Chunk | None]:
        """Ask the tiers fastest first, each for the keys still missing (``read(tier, indexes)``);
        a hit in a lower tier is promoted (as ``promoted(chunk)``) into the faster tiers."""
        gens = [self._gen[self._stripe(k)] for k in ks]
        out: list[Chunk | None] = [None] * len(ks)
        missing = list(range(len(ks)))
        for t, tier in enumerate(self.tiers):
            if not missing:
                break
            try:
                found = read(tier, missing)
            except StoreError as e:  # a sick tier is a miss; the next tier may have the chunk
                self._tier_failed(t, "read", len(missing), e)
                continue
            still: list[int] = []
            promote: list[tuple[str, Chunk, int]] = []
            for i, chunk in zip(missing, found, strict=True):
                if chunk is None:
                    still.append(i)
                    continue
                out[i] = chunk
                self.hits[t] += 1
                if t:
                    promote.append((ks[i], promoted(chunk), gens[i]))
            if promote:
                self._promote(self.tiers[:t], promote)
            if len(still) < len(missing):
                self._tell_slower(t, [ks[i] for i in missing if out[i] is not None])
            missing = still
        self.misses += len(missing)
        return out

    def contains(self, key: Key) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[Key]) -> list[bool]:
        """Ask the fastest tier first; slower tiers only see the keys still missing.

        A tier that fails to answer (a store error) is a miss for those keys, counted in
        ``lookup_failures`` and logged once per kind: a lookup never raises for a sick tier.
        """
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                found = tier.batched_contains([keys[i] for i in todo])
            except StoreError as e:
                self._tier_failed(t, "lookup", len(todo), e)
                continue
            for i, hit in zip(todo, found, strict=True):
                out[i] = hit
            todo = [i for i, hit in zip(todo, found, strict=True) if not hit]
        return out

    def remove(self, key: Key) -> bool:
        names = [as_key_string(key)]
        removed = False
        self._begin_writes(names)
        try:
            for tier in self.tiers:
                removed = tier.remove(key) or removed
        finally:
            self._end_writes(names)
        return removed

    def note_accessed(self, keys: Sequence[Key]) -> None:
        """A tier in front of this stack served ``keys``: every tier hears of it."""
        for tier in self.tiers:
            hint = getattr(tier, "note_accessed", None)
            if hint is not None:
                hint(keys)

    def note_identity(self, identity: Any) -> None:
        """The writer's model identity (its keys carry its token): every tier that records
        manifests hears of it (:meth:`kvbucket.backends.remote.RemoteBackend.note_identity`)."""
        for tier in self.tiers:
            note = getattr(tier, "note_identity", None)
            if note is not None:
                note(identity)

    def report_status(self) -> dict[str, Any]:
        """Hits per tier, misses, and each tier's own status; ``["fleet"]`` is the first remote
        tier's fleet view (as the L2 adapter's ``report_status()["fleet"]``), None without one."""
        tiers = [_status(tier) for tier in self.tiers]
        fleets = [t["fleet"] for t in tiers if t.get("fleet") is not None]
        return {"tier": type(self).__name__, "hits": list(self.hits), "misses": self.misses,
                "tier_skips": list(self.tier_skips), "tiers": tiers, "fleet": fleets[0] if fleets else None}

    def list(self) -> list[str]:
        seen: dict[str, None] = {}
        for tier in self.tiers:
            for k in tier.list():
                seen.setdefault(k, None)
        return list(seen)

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_SECS) -> FlushResult:
        """Flush every tier within one overall ``timeout``; the tiers' counts added up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = FlushResult()
        for tier in self.tiers:
            rest = None if deadline is None else max(0.0, deadline - time.monotonic())
            res = tier.flush(rest)
            if res is not None:  # a plugin tier may still answer None
                out += res
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writers is not None:
            self._writers.shutdown(wait=True)  # bounded: DEFAULT_CLOSE_TIMEOUT_SECS
        errors: list[BaseException] = []
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as e:
                errors.append(e)
        flush_all()  # the counts of repeated failures, before the caller reports
        if errors:
            raise errors[0]

    def _tier_failed(self, t: int, what: str, n: int, err: StoreError) -> None:
        self.lookup_failures[t] += n
        if isinstance(err, CircuitOpenError):  # the breaker logged when it opened
            return
        _repeated.warning("%s in tier %s failed (%s: %s); answered as a miss", what,
                          type(self.tiers[t]).__name__, type(err).__name__, err,
                          same=f"{what} in tier {t} failed: {type(err).__name__}")

    def _tell_slower(self, t: int, keys: list[str]) -> None:
        """Tiers behind tier ``t`` hear that it served ``keys`` (a hint: failures are not errors)."""
        for tier in self.tiers[t + 1 :]:
            hint = getattr(tier, "note_accessed", None)
            if hint is None:
                continue
            try:
                hint(keys)
            except Exception as e:
                log.debug("access hint to %s failed: %s", type(tier).__name__, e)

    def _stripe(self, key: str) -> int:
        return zlib.crc32(key.encode()) % _STRIPES

    def _begin_writes(self, keys: list[str]) -> None:
        for key in keys:
            s = self._stripe(key)
            with self._gen_locks[s]:
                self._gen[s] += 1
                self._writing[s] += 1

    def _end_writes(self, keys: list[str]) -> None:
        for key in keys:
            s = self._stripe(key)
            with self._gen_locks[s]:
                self._gen[s] += 1
                self._writing[s] -= 1

    def _promote(self, faster: list[StorageBackend], items: list[tuple[str, Chunk, int]]) -> None:
        for key, chunk, gen in items:
            s = self._stripe(key)
            with self._gen_locks[s]:
                if self._gen[s] != gen or self._writing[s]:
                    self.promotions_skipped += 1
                    continue
                for tier in faster:
                    try:
                        if tier.contains(key):
                            continue
                        tier.put(key, chunk, blocking=self.promote_blocking)
                    except Exception as e:  # a cache fill that failed is not an error for the reader
                        self.promotion_failures += 1
                        log.debug("promotion of %s into %s failed: %s", key, type(tier).__name__, e)
