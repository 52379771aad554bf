"""Versions of a bucket's objects: the Xet hash, read afresh, and deletes that name it.

``get_versions`` asks paths-info for each object's current Xet hash (never the metadata cache)
and reads those bytes through hf_xet (:meth:`HubBucketClient.download_afresh`): a new
reconstruction, connections and a decoder other than the first read's, so damage done on the
wire, or a reconstruction that pointed elsewhere, is not seen again. The version is the hash.

``delete_versions`` asks paths-info again and removes, in one ``deleteFile`` batch, only the
paths whose hash is still the one judged; a changed hash is "someone wrote it since", kept. The
Hub's batch API takes no condition, so a write committed between that paths-info and the batch
is removed with it. The window is bounded here (the batch is sent within half of
``delete_window_secs`` of its compare, else compared again, and neither it nor a retry starts past
the whole window) and closed by the writer, who asks again ``recheck_delay_secs`` after its commit
and adds back what was removed (stores/hub/rechecks.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult, VersionedDelete
from kvbucket.stores.deadline import deadline_in
from kvbucket.stores.hub.client import HUB_BATCH_LIMIT
from kvbucket.stores.hub.rechecks import HUB_DELETE_WINDOW, note_late, window_deadline

# ``store`` below is an HFBucketStore (not imported: the store imports this module).
HFBucketStore = Any

#: Compares of one batch before its delete is given up (kept) when each answer comes too late.
COMPARES = 3


def get_versions(store: HFBucketStore, names: Sequence[str]) -> list[ItemResult]:
    if not names:
        return []
    paths = [store._path(n) for n in names]
    deadline = deadline_in(store.config.load_timeout_secs)
    try:
        meta = store._lookup(paths, deadline, use_cache=False)
    except StoreError as e:
        return [ItemResult(n, error=e) for n in names]
    out = []
    for n, p in zip(names, paths, strict=True):
        f = meta[p]
        if f is None:
            out.append(ItemResult(n))
            continue
        data = bytearray(f.size)
        try:
            store._client.download_afresh(f, memoryview(data))
        except Exception as e:
            out.append(ItemResult(n, error=store._client.error(e, f"download {f.path!r}")))
            continue
        out.append(ItemResult(n, size=f.size, data=bytes(data), version=f.xet_hash))
    return out


def delete_versions(store: HFBucketStore, names: Sequence[str], versions: Sequence[str]
                    ) -> list[VersionedDelete]:
    if not names:
        return []
    paths = [store._path(n) for n in names]
    deadline = deadline_in(store.config.store_timeout_secs)
    wanted: dict[str, tuple[str, str]] = {}  # path -> (name, version): the first one asked
    for n, p, v in zip(names, paths, versions, strict=True):
        wanted.setdefault(p, (n, v))
    order = list(wanted)
    out: dict[str, VersionedDelete] = {}
    for i in range(0, len(order), HUB_BATCH_LIMIT):  # each batch right after its own compare
        out.update(_delete_batch(store, order[i : i + HUB_BATCH_LIMIT], wanted, deadline))
    return [out[p] if wanted[p][1] == v or not out[p].removed else VersionedDelete(n, changed=True)
            for n, p, v in zip(names, paths, versions, strict=True)]


def _delete_batch(store: HFBucketStore, chunk: list[str], wanted: dict[str, tuple[str, str]],
                  deadline: float) -> dict[str, VersionedDelete]:
    """Compare, then send the delete within half of ``delete_window_secs`` of the compare (else
    compare again); no send or retry starts past the whole window (stores/hub/rechecks.py)."""
    window = store.config.delete_window_secs
    out: dict[str, VersionedDelete] = {}
    doomed: list[str] = []
    for attempt in range(COMPARES):
        compared_at = time.monotonic()
        try:  # in this thread, right before the batch: the window is this answer's way back
            found = store._client.paths_info(chunk, deadline)
        except StoreError as e:
            return {p: VersionedDelete(wanted[p][0], error=e) for p in chunk}
        doomed.clear()
        for p in chunk:
            f = found.get(p)
            if f is None:
                out[p] = VersionedDelete(wanted[p][0])
            elif f.xet_hash != wanted[p][1]:
                out[p] = VersionedDelete(wanted[p][0], changed=True)
            else:
                doomed.append(p)
        if not doomed or time.monotonic() - compared_at <= window / 2:
            break
        if attempt + 1 < COMPARES:  # counted only when another compare follows
            HUB_DELETE_WINDOW.labels("recompared").inc()
    else:
        HUB_DELETE_WINDOW.labels("gave_up").inc()
        err = StoreError(f"{len(doomed)} delete(s) on {store.url} were not sent: the Hub answered each of "
                         f"{COMPARES} compares later than delete_window_secs/2={window / 2:g}s; kept")
        return {**out, **{p: VersionedDelete(wanted[p][0], error=err) for p in doomed}}
    store.rechecks.forget(doomed, [wanted[p][1] for p in doomed])
    store._cache.written(doomed)
    failed = store._delete_batch(doomed, window_deadline(compared_at, window, deadline)) if doomed else {}
    note_late(compared_at, store.config.recheck_delay_secs)
    for p in doomed:
        out[p] = VersionedDelete(wanted[p][0], error=failed[p]) if p in failed \
            else VersionedDelete(wanted[p][0], removed=True)
    store._cache.set_written((p, None) for p in doomed if p not in failed)
    store._cache.written(failed)
    return out


__all__ = ["delete_versions", "get_versions"]
