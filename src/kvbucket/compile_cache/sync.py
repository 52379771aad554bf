"""Sync: upload the good local entries a store lacks, in batches and three phases.

Phases: the entries' data files with their checksum records (sums.py), then their completion
markers, then per-model references and export records. A marker is only sent for an entry whose
every file and record landed, so a crash or a failed item leaves an entry without marker, which
fetch ignores and the next sync completes.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from kvbucket.compile_cache.layout import CacheLayout, EntryState, LocalEntry
from kvbucket.compile_cache.lookup import make_record, record_name
from kvbucket.compile_cache.packs import PACK_BYTES, BuiltPack, build_pack, pack_dir
from kvbucket.compile_cache.sums import is_sums_name, make_sums, sums_name
from kvbucket.compile_cache.transfer import (
    BATCH_BYTES,
    BATCH_FILES,
    LOCK_NAME,
    ModelScope,
    TransferReport,
    batches,
    close_views,
    list_remote,
    open_map,
    progress_bar,
)
from kvbucket.errors import KVBucketError
from kvbucket.stores.base import ObjectStore


class SyncBusyError(KVBucketError):
    """Another process on this host holds the cache dir's sync lock for longer than we wait."""


def sync(store: ObjectStore, layout: CacheLayout, root: Path, *, groups: Sequence[str] | None = None,
         scope: ModelScope | None = None, attribute: Iterable[str] = (), progress: bool = False,
         batch_files: int = BATCH_FILES, batch_bytes: int = BATCH_BYTES,
         lock_timeout: float = 600.0, packs: bool = True, pack_bytes: int = PACK_BYTES) -> TransferReport:
    """Upload every good local entry the store lacks; then references and the export record.

    ``attribute`` names the entries this model produced (they get per-model references when
    ``scope`` is given; without a scope only the flat area is written). Holds the cache dir's
    sync lock, so one process per host writes at a time. With ``packs``, the entries this run
    published are also written as pack objects of at most ``pack_bytes`` (see packs.py), after
    their flat copies and markers, so fetch can take them in a few requests.
    """
    root = Path(root)
    report = TransferReport("sync")
    if not root.is_dir():
        return report
    lock = FileLock(str(root / LOCK_NAME), timeout=lock_timeout)
    try:
        lock.acquire()
    except Timeout:
        raise SyncBusyError(
            f"another process has been syncing {root} for over {lock_timeout:.0f} s "
            f"(lock {root / LOCK_NAME}); try again later, or remove the lock file if no kvbucket "
            "process is running"
        ) from None
    try:
        _sync_locked(store, layout, root, report, groups, scope, set(attribute), progress, batch_files,
                     batch_bytes, pack_bytes if packs else 0)
    finally:
        lock.release()
    return report


def _sync_locked(store: ObjectStore, layout: CacheLayout, root: Path, report: TransferReport,
                 groups: Sequence[str] | None, scope: ModelScope | None, attribute: set[str], progress: bool,
                 batch_files: int, batch_bytes: int, pack_bytes: int) -> None:
    local = layout.scan(root)
    if groups is not None:
        local = [e for e in local if e.group in groups]
    good = [e for e in local if e.state is EntryState.GOOD]
    report.held_back.update(e.state.value for e in local if e.state is not EntryState.GOOD)
    record_groups = sorted({e.group for e in good if e.name in attribute} or set(groups or ()))
    if not good and not (scope and scope.config and record_groups):
        return
    objects = list_remote(store, layout.list_prefixes(sorted({e.group for e in good}) or groups))
    names = set(objects)

    plan: list[tuple[LocalEntry, list[str]]] = []
    for e in good:
        marker = layout.marker(e.name)
        missing = [f for f in e.files if f not in names and f != marker]
        if missing or marker not in names:
            plan.append((e, missing))
        else:
            report.skipped.append(e.name)

    failed: dict[str, str] = {}
    built: list[tuple[str, BuiltPack]] = []
    landed: list[str] = []  # packs that landed
    bar = progress_bar(progress, sum(e.nbytes for e, _ in plan), "sync")
    try:
        # phase 1: data files, and each entry's checksum record (sums.py) in the same batches
        files: list[tuple[str, str, Any, int]] = [(e.name, f, None, e.files[f]) for e, missing in plan
                                                  for f in missing]
        for e, _ in plan:
            try:
                record = make_sums(root, e)
            except OSError as exc:
                failed[e.name] = f"cannot checksum {e.name}: {exc.strerror or exc}"
                continue
            files.append((e.name, sums_name(layout, e.name), record, len(record)))
        for batch in batches(files, lambda x: x[3], batch_files, batch_bytes):
            _put_batch(store, root, [x[:3] for x in batch], failed, report, bar)
        # phase 2: markers, only for entries whose every file landed
        marks = []
        for e, _ in plan:
            if e.name in failed:
                continue
            payload = layout.marker_payload(e)
            marks.append((e.name, layout.marker(e.name), payload))
        # packs of those entries ride in the same puts (their indexes go in phase 3)
        built = _build_packs(layout, root, [e for e, _ in plan if e.name not in failed], scope, attribute,
                             pack_bytes) if pack_bytes > 0 else []
        items: list[tuple[str, str, Any]] = marks + [("", n, bp) for n, bp in built]
        for batch in batches(items, _payload_size, batch_files, batch_bytes):
            landed += _put_batch(store, root, batch, failed, report, bar)
    finally:
        bar.close()
        for _, bp in built:
            bp.file.close()
    for e, _ in plan:
        if e.name in failed:
            report.failed[e.name] = failed[e.name]
        else:
            report.transferred.append(e.name)
            names.add(layout.marker(e.name))
            names.update(e.files)
    packs = dict(built)
    for n in sorted(set(packs) - set(landed)):
        report.pack_errors.append(f"pack {n} not written: {failed.get(n, 'unknown error')}")
    indexes: dict[str, tuple[bytes, int]] = {}
    for n in landed:
        data, count = packs[n].index(n, set(report.failed))
        if count:
            indexes[n[: -len(".pack")] + ".json"] = (data, count)
    _phase3(store, layout, report, good, names, scope, attribute, record_groups, indexes, batch_files,
            batch_bytes)


def _phase3(store: ObjectStore, layout: CacheLayout, report: TransferReport, good: list[LocalEntry],
            names: set[str], scope: ModelScope | None, attribute: set[str], record_groups: list[str],
            indexes: dict[str, tuple[bytes, int]], batch_files: int, batch_bytes: int) -> None:
    """Pack indexes (each a pack's completion record), per-model references and export records."""
    extra: list[tuple[str, bytes]] = [(n, data) for n, (data, _) in indexes.items()]
    if scope is None:  # references and records never without a model id
        for batch in batches(extra, lambda x: len(x[1]), batch_files, batch_bytes):
            _count_indexes(store.put_many(batch), indexes, report)
        return
    for e in good:
        if e.name not in attribute or e.name in report.failed:
            continue
        ref = f"{layout.model_area(e.group, scope.write_path())}/{layout.ref_leaf(e.name)}"
        if ref not in names:
            extra.append((ref, json.dumps({"entry": e.name}).encode()))
    records: list[tuple[str, bytes]] = []
    if scope.config and not attribute & set(report.failed):  # a record says "compiled": only when true
        for g in record_groups:
            records.append((record_name(scope.model_id, scope.task, g, scope.config),
                            make_record(scope.model_id, scope.task, g, layout.name, scope.config)))
        if records:
            present = {r.name for r in store.head_many([n for n, _ in records]) if r.found}
            records = [(n, b) for n, b in records if n not in present]
    record_names = {n for n, _ in records}
    for batch in batches(extra + records, lambda x: len(x[1]), batch_files, batch_bytes):
        results = store.put_many(batch)
        _count_indexes(results, indexes, report)
        for r in results:
            if r.name in indexes:
                continue
            if r.ok and r.name in record_names:
                report.records += 1
            elif not r.ok:
                report.failed[r.name] = str(r.error)


def _build_packs(layout: CacheLayout, root: Path, entries: list[LocalEntry], scope: ModelScope | None,
                 attribute: set[str], pack_bytes: int) -> list[tuple[str, BuiltPack]]:
    """Pack the entries this sync publishes: per group and model area, packs of <= ``pack_bytes``.

    A pack that fails to land costs nothing but speed (its entries are in the flat area), so it
    is reported in ``pack_errors``, never as a failed entry.
    """
    areas: dict[str, list[LocalEntry]] = {}
    for e in entries:
        if e.nbytes > pack_bytes or e.nbytes == 0:
            continue  # one entry bigger than a pack: the per-file copy is as good
        area = scope.write_path() if scope is not None and e.name in attribute else None
        areas.setdefault(pack_dir(layout, e.group, area), []).append(e)
    built: list[tuple[str, BuiltPack]] = []
    try:
        for folder, es in sorted(areas.items()):
            for batch in batches(es, lambda e: e.nbytes, 1 << 30, pack_bytes):
                bp = build_pack(root, batch)
                if bp is not None:
                    built.append((f"{folder}{bp.sha256}.pack", bp))
    except BaseException:
        for _, bp in built:
            bp.file.close()
        raise
    return built


def _payload_size(item: tuple[str, str, Any]) -> int:
    payload = item[2]
    if isinstance(payload, BuiltPack):
        return payload.size
    return len(payload) if payload is not None else 0


def _count_indexes(results: list[Any], indexes: dict[str, tuple[bytes, int]], report: TransferReport) -> None:
    for r in results:
        if r.name not in indexes:
            continue
        if r.ok:
            report.packs += 1
            report.pack_entries += indexes[r.name][1]
        else:
            report.pack_errors.append(f"pack index {r.name} not written (the pack is ignored): {r.error}")


def _map_file(f: Any, size: int) -> Any:
    if size == 0:
        return b""
    return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


def _put_batch(store: ObjectStore, root: Path, batch: Sequence[tuple[str, str, Any]],
               failed: dict[str, str], report: TransferReport, bar: Any) -> list[str]:
    """Put (entry, object name, payload or None = the local file of that name); record failures.

    Entry ``""`` marks a pack (payload a :class:`BuiltPack`): it is not an entry's file, so it is
    not counted in ``files``/``bytes``; its name is returned when it landed, and a failure is
    recorded under its own name.
    """
    items: list[tuple[str, Any]] = []
    landed: list[str] = []
    owners: dict[str, str] = {}
    views: list[Any] = []
    try:
        for entry, name, payload in batch:
            if entry in failed:
                continue
            if isinstance(payload, BuiltPack):
                payload = _map_file(payload.file, payload.size)
                views.append(payload)
            elif payload is None:
                try:
                    payload = open_map(root / name)
                except OSError as exc:
                    failed[entry] = f"cannot read {name}: {exc.strerror or exc}"
                    continue
                views.append(payload)
            items.append((name, payload))
            owners[name] = entry
        if not items:
            return landed
        for r in store.put_many(items):
            if owners[r.name] == "":
                if r.ok:
                    landed.append(r.name)
                else:
                    failed[r.name] = str(r.error)
            elif is_sums_name(r.name):  # metadata: not one of the entry's files, but it must land
                if not r.ok:
                    failed.setdefault(owners[r.name], f"{r.name}: {r.error}")
            elif r.ok:
                report.files += 1
                report.bytes += int(r.size or 0)
                bar.update(int(r.size or 0))
            else:
                failed.setdefault(owners[r.name], f"{r.name}: {r.error}")
    finally:
        del items
        close_views(views)
    return landed


def entries_by_state(layout: CacheLayout, root: Path) -> dict[str, list[LocalEntry]]:
    out: dict[str, list[LocalEntry]] = {s.value: [] for s in EntryState}
    for e in layout.scan(Path(root)):
        out[e.state.value].append(e)
    return out


__all__ = ["SyncBusyError", "entries_by_state", "sync"]
