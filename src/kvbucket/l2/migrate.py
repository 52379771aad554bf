"""Rewrite LMCache-format objects as sealed kvbucket chunks, in place (``kvbucket migrate``).

A bucket (or directory) LMCache 0.5.6's built-in adapter filled holds raw chunk bytes under
LMCache's names (:mod:`kvbucket.l2.naming`). kvbucket reads them as they are, but only its own
sealed chunks are verified on every load. Migration rewrites each LMCache-format object as the
sealed chunk of the same key under kvbucket's name, then (unless ``keep_source``) deletes the
LMCache-format object, batch by batch.

Resumable by construction: a run lists what is still in LMCache's format; a sealed chunk already
under the kvbucket name (a run stopped between write and delete, or ``keep_source``) is not
written again, its source is only deleted. A source is deleted only after its chunk landed, so a
failure at any point loses nothing. Run it when no node still writes LMCache's format
(``"object_format": "lmcache"``), or those nodes' new chunks stay in LMCache's format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbucket.batching import batches
from kvbucket.l2.naming import Naming
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.sealed import SealedStore, seal_store

BATCH_ITEMS = 64
BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Move:
    """One LMCache-format object and the kvbucket name its key is written under."""

    source: str
    target: str
    size: int


@dataclass
class MigrateReport:
    found: int = 0  # LMCache-format objects listed
    found_bytes: int = 0
    written: int = 0  # sealed chunks written by this run
    written_bytes: int = 0
    already: int = 0  # sealed chunks that were there already (an earlier run, or keep_source)
    deleted: int = 0  # LMCache-format objects removed
    failed: list[tuple[str, str]] = field(default_factory=list)  # (source name, reason)


def plan(store: ObjectStore, naming: Naming, prefix: str = "") -> list[Move]:
    """Every object of ``store`` (under ``prefix``) in LMCache's format, with its kvbucket name."""
    moves = []
    for info in store.list(prefix):
        key = naming.parse_lmcache(info.name)
        if key is not None:
            moves.append(Move(info.name, naming.kvbucket_name(key), info.size))
    return moves


def _batches(moves: Sequence[Move]) -> Iterator[list[Move]]:
    return batches(moves, lambda x: x.size, BATCH_ITEMS, BATCH_BYTES)


def migrate(
    store: ObjectStore,
    naming: Naming,
    moves: Sequence[Move],
    *,
    tier: str = "l2",
    encryption: Any = None,
    keep_source: bool = False,
    progress: Callable[[int], None] | None = None,
) -> MigrateReport:
    """Seal each move's object under its target name; delete the source once its chunk is there.

    ``store`` is the raw store (as LMCache sees it); ``tier`` is the one that will read the
    chunks (``l2`` for the MP adapter, ``connector`` for the non-MP connector) and
    ``encryption`` its setting, so the chunks are sealed as that tier seals its own.
    ``progress`` is called with the bytes of each finished batch."""
    sealed: SealedStore = seal_store(store, tier=tier, encryption=encryption)
    report = MigrateReport(found=len(moves), found_bytes=sum(m.size for m in moves))
    for batch in _batches(moves):
        done: list[Move] = []
        there = sealed.head_many([m.target for m in batch])
        todo = []
        for m, h in zip(batch, there, strict=True):
            if h.found and h.size == m.size:
                report.already += 1
                done.append(m)
            else:
                todo.append(m)
        if todo:
            got = store.get_many([m.source for m in todo])
            items, sources = [], []
            for m, r in zip(todo, got, strict=True):
                if r.error is not None:
                    report.failed.append((m.source, f"read: {r.error}"))
                elif r.data is None:
                    report.failed.append((m.source, "gone since the listing"))
                else:
                    items.append((m.target, r.data))
                    sources.append(m)
            for m, r in zip(sources, sealed.put_many(items) if items else [], strict=True):
                if r.error is not None:
                    report.failed.append((m.source, f"write: {r.error}"))
                else:
                    report.written += 1
                    report.written_bytes += m.size
                    done.append(m)
        if done and not keep_source:
            for m, r in zip(done, store.delete_many([m.source for m in done]), strict=True):
                if r.error is not None:
                    report.failed.append((m.source, f"delete: {r.error}"))
                else:
                    report.deleted += 1
        if progress is not None:
            progress(sum(m.size for m in batch))
    return report


__all__ = ["MigrateReport", "Move", "migrate", "plan"]
