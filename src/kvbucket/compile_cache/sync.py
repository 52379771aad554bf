"""Fetch and sync: move good entries between a local cache dir and an object store, in batches.

Both directions start from ONE listing of the remote area (a request per 1,000 objects) and
diff it against the local scan, so each run moves exactly what is missing, whatever happened
before (entries compiled before a ``with`` block, an interrupted sync, another host's uploads).

Sync uploads in three batched phases: the entries' data files, then their completion markers,
then per-model references and export records. A marker is only sent for an entry whose every
file landed, so a crash or a failed item leaves an entry without marker, which fetch ignores
and the next sync completes. Fetch only takes entries whose marker is present, writes each into
a temp dir next to its final place and renames it in, so a crash never leaves a half entry that
looks good locally.

Requests: every store call takes up to ``batch_files`` (1,000) objects (and ``batch_bytes``).
Files are handed to the store as memory maps, and read into memory-mapped temp files, so a
batch of large NEFFs does not have to fit in the Python heap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock, Timeout

from kvbucket.compile_cache.layout import LOCAL_RESERVED_PREFIX, CacheLayout, EntryState, LocalEntry
from kvbucket.compile_cache.lookup import config_id, make_record, model_path, record_name, task_segment
from kvbucket.compile_cache.packs import (
    PACK_BYTES,
    PACKS_PREFIX,
    SMALL_PACK,
    BuiltPack,
    PackError,
    PackIndex,
    build_pack,
    entry_complete,
    group_of_pack,
    pack_dir,
    parse_index,
    verify,
)
from kvbucket.errors import InvalidKeyError, KVBucketError
from kvbucket.stores.base import ObjectStore, check_name

log = logging.getLogger("kvbucket.compile_cache")

BATCH_FILES = 1000
BATCH_BYTES = 1 << 30
#: Threads writing entries out of a downloaded pack (creating files is the cost that remains).
INSTALL_THREADS = 8
LOCK_NAME = f"{LOCAL_RESERVED_PREFIX}-sync.lock"
TMP_PREFIX = f"{LOCAL_RESERVED_PREFIX}-tmp-"

T = TypeVar("T")


class SyncBusyError(KVBucketError):
    """Another process on this host holds the cache dir's sync lock for longer than we wait."""


@dataclass(frozen=True, slots=True)
class ModelScope:
    """A model (and optionally a task and an export config) whose per-model area is used."""

    model_id: str
    task: str | None = None
    config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        model_path(self.model_id)  # validate early, with the user's words
        if self.task is not None:
            task_segment(self.task)
        config_id(self.config)

    def write_path(self) -> str:
        """``org/name/<task>/<config id>``: where this run's references go."""
        return f"{model_path(self.model_id)}/{task_segment(self.task)}/{config_id(self.config)}"

    def read_path(self) -> str:
        """The narrowest prefix the scope pins down (no task: every task of the model)."""
        p = f"{model_path(self.model_id)}/"
        if self.task is not None:
            p += f"{task_segment(self.task)}/"
            if self.config:
                p += f"{config_id(self.config)}/"
        return p


@dataclass
class TransferReport:
    """What one fetch or sync did. Only items that landed are counted."""

    direction: str
    transferred: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    held_back: Counter[str] = field(default_factory=Counter)  # local entries not published, by state
    files: int = 0
    bytes: int = 0
    records: int = 0
    packs: int = 0  # pack objects (with their index) that landed on sync / were used on fetch
    pack_entries: int = 0  # entries written into / taken from those packs
    pack_errors: list[str] = field(default_factory=list)  # packs not written or refused, and why

    def summary(self) -> str:
        s = (f"{self.direction}: {len(self.transferred)} entries ({self.files} files, {self.bytes} bytes) "
             f"transferred, {len(self.skipped)} already there")
        if self.packs:
            s += f", {self.pack_entries} entries via {self.packs} packs"
        if self.failed:
            s += f", {len(self.failed)} failed"
        if self.pack_errors:
            s += f", {len(self.pack_errors)} pack problems (fell back to per-file)"
        if self.held_back:
            s += ", not published: " + ", ".join(f"{n} {k}" for k, n in sorted(self.held_back.items()))
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"direction": self.direction, "transferred": self.transferred, "skipped": self.skipped,
                "failed": self.failed, "held_back": dict(self.held_back), "files": self.files,
                "bytes": self.bytes, "records": self.records, "packs": self.packs,
                "pack_entries": self.pack_entries, "pack_errors": self.pack_errors}


def batches(items: Iterable[T], size_of: Callable[[T], int], max_items: int = BATCH_FILES,
            max_bytes: int = BATCH_BYTES) -> Iterator[list[T]]:
    """Split into batches of at most ``max_items`` items and (unless one item is larger) ``max_bytes``."""
    batch: list[T] = []
    nbytes = 0
    for it in items:
        n = size_of(it)
        if batch and (len(batch) >= max_items or nbytes + n > max_bytes):
            yield batch
            batch, nbytes = [], 0
        batch.append(it)
        nbytes += n
    if batch:
        yield batch


def list_remote(store: ObjectStore, prefixes: Sequence[str]) -> dict[str, int]:
    """Name -> size of every object under the prefixes (prefixes nested in another are skipped).

    Names become local paths on fetch, so a name that could climb out of the cache dir (``..``,
    absolute, backslashes: only a hostile or broken server would list one) is dropped here.
    """
    out: dict[str, int] = {}
    for p in sorted(set(prefixes)):
        if any(q != p and p.startswith(q) for q in prefixes):
            continue
        for o in store.list(p):
            try:
                check_name(o.name)
            except InvalidKeyError:
                log.warning("ignoring remote object with an unsafe name: %r", o.name[:200])
                continue
            out[o.name] = o.size
    return out


def _remote_entries(layout: CacheLayout, objects: dict[str, int]) -> dict[str, dict[str, int]]:
    entries: dict[str, dict[str, int]] = {}
    for name, size in objects.items():
        e = layout.entry_of(name)
        if e is not None:
            entries.setdefault(e, {})[name] = size
    return entries


def _progress(progress: bool, total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False)


def _open_map(path: Path) -> Any:
    """A read-only view of a file's bytes (a memory map; ``b""`` for an empty file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _close(views: Iterable[Any]) -> None:
    for v in views:
        if isinstance(v, mmap.mmap):
            with contextlib.suppress(BufferError):
                v.close()


# ---- sync (upload) --------------------------------------------------------------------------

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
    bar = _progress(progress, sum(e.nbytes for e, _ in plan), "sync")
    try:
        # phase 1: data files
        files = [(e, f) for e, missing in plan for f in missing]
        for batch in batches(files, lambda x: x[0].files[x[1]], batch_files, batch_bytes):
            _put_batch(store, root, [(e.name, f, None) for e, f in batch], failed, report, bar)
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
                    payload = _open_map(root / name)
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
            elif r.ok:
                report.files += 1
                report.bytes += int(r.size or 0)
                bar.update(int(r.size or 0))
            else:
                failed.setdefault(owners[r.name], f"{r.name}: {r.error}")
    finally:
        del items
        _close(views)
    return landed


# ---- fetch (download) -------------------------------------------------------------------------

def fetch(store: ObjectStore, layout: CacheLayout, root: Path, *, groups: Sequence[str] | None = None,
          scope: ModelScope | None = None, select: Callable[[str], bool] | None = None,
          progress: bool = False, batch_files: int = BATCH_FILES,
          batch_bytes: int = BATCH_BYTES, packs: bool = True) -> TransferReport:
    """Download the complete remote entries (of ``scope``'s model, else the whole flat area).

    ``select`` further narrows the entries by name (e.g. the torch layout's user key).

    Local entries that are good or in progress are left alone; failed or incomplete ones are
    replaced by a good remote copy. With ``packs``, entries are taken from verified pack objects
    where a pack holds them (one more listing finds the packs, and only when entries are missing),
    the rest file by file.
    """
    root = Path(root)
    report = TransferReport("fetch")
    prefixes = layout.list_prefixes(groups)
    objects = list_remote(store, prefixes)
    names = set(objects)
    remote = _remote_entries(layout, objects)
    complete = {e for e in remote if layout.remote_complete(e, names)}
    if groups is not None:
        complete = {e for e in complete if layout.group_of(e) in groups}
    if scope is not None:
        wanted: set[str] = set()
        for g in sorted({layout.group_of(e) for e in complete}):
            area = layout.model_area(g, scope.read_path())
            for n in names:
                if n.startswith(area):
                    try:
                        wanted.add(layout.entry_from_leaf(g, n.rsplit("/", 1)[-1]))
                    except InvalidKeyError:
                        continue  # not a reference kvbucket wrote
        wanted &= complete
    else:
        wanted = complete
    if select is not None:
        wanted = {e for e in wanted if select(e)}
    local = {e.name: e.state for e in layout.scan(root)}
    todo = []
    for e in sorted(wanted):
        st = local.get(e)
        if st in (EntryState.GOOD, EntryState.IN_PROGRESS):
            report.skipped.append(e)
        else:
            todo.append(e)
    if not todo:
        return report
    root.mkdir(parents=True, exist_ok=True)
    if packs:
        if "" not in prefixes:  # one more listing, only when something is missing: the packs area
            head = f"{PACKS_PREFIX}{layout.name}/"
            objects = {**objects, **list_remote(store, [f"{head}{g}/" for g in
                                                        sorted({layout.group_of(e) for e in todo})])}
        todo = _fetch_packs(store, layout, root, objects, remote, todo, report, batch_files, batch_bytes)
    files = [(e, n, remote[e][n]) for e in todo for n in sorted(remote[e])]
    _download(store, layout, root, todo, files, report, progress, batch_files, batch_bytes)
    return report


def _fetch_packs(store: ObjectStore, layout: CacheLayout, root: Path, objects: dict[str, int],
                 remote: dict[str, dict[str, int]], todo: list[str], report: TransferReport,
                 batch_files: int, batch_bytes: int) -> list[str]:
    """Install the ``todo`` entries that complete, verified packs hold; return the rest.

    Indexes are read in one batched get; each wanted entry is taken from one pack (the packs
    holding most wanted entries first; later syncs and other hosts may have packed it again), and
    only when the packed files are exactly those the flat area lists now (an entry of a directory
    cache can grow after it was packed: the stale pack copy is then not used). A
    pack is downloaded only when at least half of its bytes are wanted (or it is small), so a
    model that needs a few entries of a big pack fetches them per file instead. Anything that
    goes wrong with a pack (missing, corrupted member, unsafe index) falls back to per-file.
    """
    groups = {layout.group_of(e) for e in todo}
    idx_names = [n for n in sorted(objects) if n.endswith(".json") and group_of_pack(layout, n) in groups
                 and objects.get(n[: -len(".json")] + ".pack", 0) > 0]
    if not idx_names:
        return todo
    indexes: list[PackIndex] = []
    for batch in batches(idx_names, lambda n: objects[n], batch_files, batch_bytes):
        for r in store.get_many(batch):
            if not r.found:
                continue  # removed since the listing: those entries go per file
            try:
                indexes.append(parse_index(layout, r.name, bytes(r.data), objects[r.name[:-5] + ".pack"]))
            except PackError as exc:
                log.warning("%s; ignoring that pack", exc)
                report.pack_errors.append(str(exc))
    wanted = set(todo)

    def useful(ix: PackIndex) -> list[str]:
        return [e for e in ix.entries if e in wanted and entry_complete(layout, e, ix.entries[e])
                and {m.name: m.size for m in ix.entries[e]} == remote.get(e)]

    plan: list[tuple[PackIndex, list[str]]] = []
    for ix in sorted(indexes, key=lambda ix: (-len(useful(ix)), ix.pack)):
        take = useful(ix)
        if take and (2 * sum(ix.entry_bytes(e) for e in take) >= ix.size or ix.size <= SMALL_PACK):
            plan.append((ix, take))
            wanted.difference_update(take)
    done: set[str] = set()
    for batch in batches(plan, lambda x: x[0].size, batch_files, batch_bytes):
        _get_packs(store, layout, root, batch, report, done)
    return [e for e in todo if e not in done]


def _get_packs(store: ObjectStore, layout: CacheLayout, root: Path, batch: list[tuple[PackIndex, list[str]]],
               report: TransferReport, done: set[str]) -> None:
    """Download packs into unnamed temp files, verify each entry's files, install the good ones."""
    tmps: list[Any] = []
    views: list[Any] = []
    try:
        for ix, _ in batch:
            f = tempfile.TemporaryFile(dir=root)  # noqa: SIM115 - closed in the finally below
            tmps.append(f)
            f.truncate(ix.size)
            views.append(mmap.mmap(f.fileno(), ix.size))
        results = store.get_many([ix.pack for ix, _ in batch], views)
        for (ix, take), view, r in zip(batch, views, results, strict=True):
            if not r.found:
                report.pack_errors.append(f"pack {ix.pack} could not be read ({r.error or 'gone'}); "
                                          "fetching its entries file by file")
                continue
            good = []
            for e in take:
                err = verify(view, ix.entries[e])
                if err is None:
                    good.append(e)
                else:
                    msg = f"pack {ix.pack}: {err}; fetching {e} file by file"
                    log.warning("%s", msg)
                    report.pack_errors.append(msg)
            # file creation dominates on slow local or network file systems: write entries in parallel
            with ThreadPoolExecutor(INSTALL_THREADS) as pool:
                futures = [pool.submit(_stage_from_pack, layout, root, e, ix.entries[e], view) for e in good]
            try:
                staged = [f.result() for f in futures]
            except BaseException:  # leave no temp dir of the entries that were staged
                for f in futures:
                    if f.done() and f.exception() is None and (st := f.result()) is not None:
                        st.discard()
                raise
            used = 0
            for e, st in zip(good, staged, strict=True):
                if st is None:
                    continue
                members = ix.entries[e]
                report.files += len(members)
                report.bytes += sum(m.size for m in members)
                _install(layout, root, st, report)
                done.add(e)
                used += 1
            if used:
                report.packs += 1
                report.pack_entries += used
    finally:
        _close(views)
        for f in tmps:
            f.close()


def _stage_from_pack(layout: CacheLayout, root: Path, entry: str, members: list[Any],
                     view: Any) -> _Staging | None:
    """Write one verified entry into its temp dir, its marker last (None on a local write error)."""
    st = _Staging(root, entry, len(members))
    marker = layout.marker(entry)
    try:
        for m in sorted(members, key=lambda m: (m.name == marker, m.name)):
            with open(st.path_of(m.name), "wb") as f:
                f.write(view[m.offset : m.offset + m.size])
    except OSError as exc:
        st.discard()
        log.warning("cannot write %s from its pack (%s); fetching it file by file", entry,
                    exc.strerror or exc)
        return None
    except BaseException:
        st.discard()
        raise
    return st


class _Staging:
    """An entry being fetched: a temp dir (or file) next to its final place."""

    def __init__(self, root: Path, entry: str, nfiles: int) -> None:
        self.entry = entry
        self.final = root / entry
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{secrets.token_hex(4)}"
        self.remaining = nfiles
        self.error: str | None = None
        self._dirs: set[Path] = set()

    def path_of(self, name: str) -> Path:
        if name == self.entry:
            return self.tmp
        p = self.tmp / name[len(self.entry) + 1 :]
        if p.parent not in self._dirs:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(p.parent)
        return p

    def discard(self) -> None:
        if self.tmp.is_dir():
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.tmp.unlink()


def _download(store: ObjectStore, layout: CacheLayout, root: Path, todo: list[str],
              files: list[tuple[str, str, int]], report: TransferReport, progress: bool, batch_files: int,
              batch_bytes: int) -> None:
    counts = Counter(e for e, _, _ in files)
    staging = {e: _Staging(root, e, counts[e]) for e in todo}
    bar = _progress(progress, sum(s for _, _, s in files), "fetch")
    try:
        for batch in batches(files, lambda x: x[2], batch_files, batch_bytes):
            _get_batch(store, batch, staging, report, bar)
            for e in {e for e, _, _ in batch}:
                st = staging[e]
                if st.remaining == 0 and st.error is None:
                    _install(layout, root, st, report)
    except BaseException:
        for st in staging.values():
            st.discard()
        raise
    finally:
        bar.close()
    for st in staging.values():
        if st.error is not None:
            st.discard()
            report.failed[st.entry] = st.error


def _get_batch(store: ObjectStore, batch: list[tuple[str, str, int]], staging: dict[str, _Staging],
               report: TransferReport, bar: Any) -> None:
    names: list[str] = []
    bufs: list[Any] = []
    owners: dict[str, str] = {}
    try:
        for e, name, size in batch:
            st = staging[e]
            if st.error is not None:
                continue
            path = st.path_of(name)
            try:
                with open(path, "wb+") as f:
                    if size == 0:
                        st.remaining -= 1
                        report.files += 1
                        continue
                    f.truncate(size)
                    bufs.append(mmap.mmap(f.fileno(), size))
            except OSError as exc:
                st.error = f"cannot write {path}: {exc.strerror or exc}"
                continue
            names.append(name)
            owners[name] = e
        if not names:
            return
        for r in store.get_many(names, bufs):
            st = staging[owners[r.name]]
            if not r.ok:
                st.error = st.error or f"{r.name}: {r.error}"
            elif r.size is None:
                st.error = st.error or f"{r.name} disappeared from the store"
            else:
                st.remaining -= 1
                report.files += 1
                report.bytes += r.size
                bar.update(r.size)
    finally:
        _close(bufs)


def _install(layout: CacheLayout, root: Path, st: _Staging, report: TransferReport) -> None:
    """Rename a fully downloaded entry into place (replacing a failed/incomplete local copy)."""
    if st.final.exists() or st.final.is_symlink():
        state = layout.entry_state(root, st.entry)
        if state in (EntryState.GOOD, EntryState.IN_PROGRESS) or st.final.is_symlink():
            st.discard()  # a compile or another fetch got there first: theirs wins
            report.skipped.append(st.entry)
            return
        trash = st.final.parent / f"{TMP_PREFIX}old-{st.final.name}-{secrets.token_hex(4)}"
        os.rename(st.final, trash)
        try:
            os.rename(st.tmp, st.final)
        finally:
            if trash.is_dir():
                shutil.rmtree(trash, ignore_errors=True)
            else:
                trash.unlink(missing_ok=True)
    else:
        try:
            os.rename(st.tmp, st.final)
        except OSError:  # appeared meanwhile (ENOTEMPTY/EEXIST): keep theirs
            st.discard()
            report.skipped.append(st.entry)
            return
    report.transferred.append(st.entry)


def entries_by_state(layout: CacheLayout, root: Path) -> dict[str, list[LocalEntry]]:
    out: dict[str, list[LocalEntry]] = {s.value: [] for s in EntryState}
    for e in layout.scan(Path(root)):
        out[e.state.value].append(e)
    return out


__all__ = [
    "BATCH_BYTES",
    "BATCH_FILES",
    "LOCK_NAME",
    "ModelScope",
    "SyncBusyError",
    "TransferReport",
    "batches",
    "entries_by_state",
    "fetch",
    "list_remote",
    "sync",
]
