"""HybridBackend: tiers in front of each other (local_cpu -> local_disk -> remote(s)).

Write-through: a put goes to every tier, so the slowest (most durable) tier always has what
was acknowledged. Read-through: a get asks the tiers in order and a hit in a lower tier is
promoted into every faster tier that missed, so the next read is served from memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvbucket.backends.base import Chunk, Key, StorageBackend
from kvbucket.errors import KVBucketError
from kvbucket.keys import as_key_string

log = logging.getLogger(__name__)


class TierPutError(KVBucketError):
    """A write-through put failed in some tiers (the message names them and why)."""


class HybridBackend(StorageBackend):
    """Tiers fastest first. A chunk counts as stored only when every tier took it.

    ``promote_blocking`` chooses whether promotions into faster tiers wait (the default,
    so a read is followed by a memory hit) or go through the tiers' non-blocking queues.
    """

    def __init__(self, tiers: Sequence[StorageBackend], *, promote_blocking: bool = True) -> None:
        if not tiers:
            raise ValueError("HybridBackend needs at least one tier")
        self.tiers = list(tiers)
        self.promote_blocking = promote_blocking
        self.hits = [0] * len(self.tiers)  # per tier, for the demo's summary and tuning
        self.misses = 0
        self.promotion_failures = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"HybridBackend({self.tiers!r})"

    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        (err,) = self.batched_put_results([(key, chunk)], blocking=blocking)
        if err is not None:
            raise err

    def batched_put_results(
        self, items: Iterable[tuple[Key, Chunk]], blocking: bool = True
    ) -> list[Exception | None]:
        items = list(items)
        failures: list[list[str]] = [[] for _ in items]
        for tier in self.tiers:
            for i, err in enumerate(tier.batched_put_results(items, blocking=blocking)):
                if err is not None:
                    failures[i].append(f"{type(tier).__name__}: {err}")
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
        out: list[Chunk | None] = [None] * len(ks)
        missing = list(range(len(ks)))
        for t, tier in enumerate(self.tiers):
            if not missing:
                break
            found = tier.batched_get([ks[i] for i in missing])
            still: list[int] = []
            promote: list[tuple[str, Chunk]] = []
            for i, chunk in zip(missing, found, strict=True):
                if chunk is None:
                    still.append(i)
                    continue
                out[i] = chunk
                self.hits[t] += 1
                if t:
                    promote.append((ks[i], chunk))
            if promote:
                self._promote(self.tiers[:t], promote)
            missing = still
        self.misses += len(missing)
        return out

    def contains(self, key: Key) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def remove(self, key: Key) -> bool:
        removed = False
        for tier in self.tiers:
            removed = tier.remove(key) or removed
        return removed

    def list(self) -> list[str]:
        seen: dict[str, None] = {}
        for tier in self.tiers:
            for k in tier.list():
                seen.setdefault(k, None)
        return list(seen)

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _promote(self, faster: list[StorageBackend], items: list[tuple[str, Chunk]]) -> None:
        for tier in faster:
            for (key, _), err in zip(items, tier.batched_put_results(items, blocking=self.promote_blocking),
                                     strict=True):
                if err is not None:  # a cache fill that failed is not an error for the reader
                    self.promotion_failures += 1
                    log.debug("promotion of %s into %s failed: %s", key, type(tier).__name__, err)
