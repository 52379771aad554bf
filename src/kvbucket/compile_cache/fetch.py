"""Fetch: download the complete remote entries a cache dir lacks, from packs or file by file.

Fetch only takes entries whose marker is present, writes each into a temp dir next to its final
place and renames it in, so a crash never leaves a half entry that looks good locally. Every byte
is checked before it is installed: pack members against their index's sha256, per-file entries
against the checksum record their sync wrote (see sums.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvbucket.compile_cache.layout import CacheLayout, EntryState
from kvbucket.compile_cache.packs import (
    PACKS_PREFIX,
    SMALL_PACK,
    PackError,
    PackIndex,
    entry_complete,
    group_of_pack,
    parse_index,
    verify,
)
from kvbucket.compile_cache.sums import (
    Sums,
    SumsError,
    listing_mismatch,
    parse_sums,
    sha256_of,
    sums_name,
)
from kvbucket.compile_cache.transfer import (
    BATCH_BYTES,
    BATCH_FILES,
    INSTALL_THREADS,
    TMP_PREFIX,
    ModelScope,
    TransferReport,
    batches,
    close_views,
    list_remote,
    log,
    progress_bar,
    remote_entries,
)
from kvbucket.errors import InvalidKeyError
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.sealed import INTEGRITY_FAILURES, INTEGRITY_VERIFIED

#: The ``tier`` label of this module's integrity metrics.
TIER = "compile_cache"


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
    remote = remote_entries(layout, objects)
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
        todo = _fetch_packs(store, layout, root, objects, remote, todo, report, batch_files, batch_bytes,
                            progress)
    files = [(e, n, remote[e][n]) for e in todo for n in sorted(remote[e])]
    _download(store, layout, root, todo, files, report, progress, batch_files, batch_bytes)
    return report


def _fetch_packs(store: ObjectStore, layout: CacheLayout, root: Path, objects: dict[str, int],
                 remote: dict[str, dict[str, int]], todo: list[str], report: TransferReport,
                 batch_files: int, batch_bytes: int, progress: bool = False) -> list[str]:
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
    with progress_bar(progress, sum(ix.size for ix, _ in plan), "fetch (packs)") as bar:
        for batch in batches(plan, lambda x: x[0].size, batch_files, batch_bytes):
            _get_packs(store, layout, root, batch, report, done)
            bar.update(sum(ix.size for ix, _ in batch))
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
        close_views(views)
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
        self.corrupt: list[str] = []  # files that failed their checksum
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
    records = _read_records(store, layout, todo, files, report, batch_files) if todo else {}
    todo = [e for e in todo if e not in report.failed]
    files = [f for f in files if f[0] not in report.failed]
    counts = Counter(e for e, _, _ in files)
    staging = {e: _Staging(root, e, counts[e]) for e in todo}
    bar = progress_bar(progress, sum(s for _, _, s in files), "fetch")
    try:
        for batch in batches(files, lambda x: x[2], batch_files, batch_bytes):
            _get_batch(store, batch, staging, records, report, bar)
            for e in {e for e, _, _ in batch}:
                st = staging[e]
                if st.remaining == 0 and st.error is None:
                    _install(layout, root, st, report)
                    if e in records:
                        INTEGRITY_VERIFIED.labels(TIER).inc(len(records[e]))
                    else:
                        report.unverified.append(e)
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
            if st.corrupt:
                _drop_corrupt(store, layout, st)


def _read_records(store: ObjectStore, layout: CacheLayout, todo: list[str], files: list[tuple[str, str, int]],
                  report: TransferReport, batch_files: int) -> dict[str, Sums]:
    """The checksum records of the entries to download, read in batched gets.

    An entry whose record cannot be read, is malformed, or disagrees with the listing is failed
    here, before a byte of it is downloaded (a miss is the safe answer: it is compiled locally).
    An entry without a record is fetched by size only and reported as unverified.
    """
    listed: dict[str, dict[str, int]] = {}
    for e, name, size in files:
        listed.setdefault(e, {})[name] = size
    owner = {sums_name(layout, e): e for e in todo}
    records: dict[str, Sums] = {}
    for batch in batches(list(owner), lambda _: 1, batch_files, 1 << 62):
        for r in store.get_many(batch):
            e = owner[r.name]
            if not r.ok:
                report.failed[e] = f"cannot read its checksum record {r.name}: {r.error}"
                continue
            if r.size is None:
                continue  # no record: written before records existed, or by another tool
            try:
                sums = parse_sums(layout, e, bytes(r.data or b""))
            except SumsError as exc:
                _refuse(report, e, str(exc), "record")
                continue
            why = listing_mismatch(sums, listed.get(e, {}))
            if why is not None:
                _refuse(report, e, f"{why} ({r.name}); not fetched", "mismatch")
                continue
            records[e] = sums
    return records


def _refuse(report: TransferReport, entry: str, why: str, reason: str) -> None:
    log.warning("compile cache entry %s refused: %s", entry, why)
    INTEGRITY_FAILURES.labels(TIER, reason).inc()
    report.failed[entry] = why


def _drop_corrupt(store: ObjectStore, layout: CacheLayout, st: _Staging) -> None:
    """Delete the files that failed their checksum, and the entry's marker, from the store.

    Without its marker the entry is incomplete for every host (fetch ignores it), and the next
    sync of a host that has it uploads the missing files and marker again.
    """
    INTEGRITY_FAILURES.labels(TIER, "checksum").inc(len(st.corrupt))
    log.warning("compile cache entry %s: %s failed its sha256 check; removing %s and the entry's "
                "marker from the store", st.entry, ", ".join(st.corrupt), "them" if len(st.corrupt) > 1
                else "it")
    try:
        results = store.delete_many([*st.corrupt, layout.marker(st.entry)])
    except Exception as exc:  # a failed cleanup must not hide the refusal itself
        log.warning("could not remove the corrupt objects of %s: %s", st.entry, exc)
        return
    for r in results:
        if not r.ok:
            log.warning("could not remove %s: %s", r.name, r.error)


def _get_batch(store: ObjectStore, batch: list[tuple[str, str, int]], staging: dict[str, _Staging],
               records: dict[str, Sums], report: TransferReport, bar: Any) -> None:
    names: list[str] = []
    bufs: list[Any] = []
    owners: dict[str, str] = {}
    sizes: dict[str, int] = {}
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
            sizes[name] = size
        if not names:
            return
        results = store.get_many(names, bufs)
        for r, buf in zip(results, bufs, strict=True):
            st = staging[owners[r.name]]
            sums = records.get(st.entry)
            if not r.ok:
                st.error = st.error or f"{r.name}: {r.error}"
            elif r.size is None:
                st.error = st.error or f"{r.name} disappeared from the store"
            elif r.size != sizes[r.name]:
                st.error = st.error or f"{r.name} has {r.size} bytes, the listing said {sizes[r.name]}"
            elif sums is not None and sha256_of(buf) != sums[r.name][1]:
                # hashed while the bytes are still in memory; never installed
                st.corrupt.append(r.name)
                st.error = st.error or (f"{r.name} does not match the sha256 in its checksum record "
                                        "(corrupted or tampered); not installed")
            else:
                st.remaining -= 1
                report.files += 1
                report.bytes += r.size
                bar.update(r.size)
    finally:
        close_views(bufs)


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


__all__ = ["fetch"]
