"""Versions of a bucket's objects: the Xet hash, read afresh, and deletes that name it.

``get_versions`` asks paths-info for each object's current Xet hash (never the metadata cache)
and reads those bytes through hf_xet (:meth:`HubBucketClient.download_afresh`): a new
reconstruction, connections and a decoder other than the first read's, so damage done on the
wire, or a reconstruction that pointed elsewhere, is not seen again. The version is the hash.

``delete_versions`` asks paths-info again and removes, in one ``deleteFile`` batch, only the
paths whose hash is still the one judged; a changed hash is "someone wrote it since", kept. The
Hub's batch API takes no condition, so a write committed between that paths-info and the batch
(one round trip) is removed with it: that window is what remains.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult, VersionedDelete
from kvbucket.stores.deadline import deadline_in
from kvbucket.stores.hub.client import HUB_BATCH_LIMIT

# ``store`` below is an HFBucketStore (not imported: the store imports this module).
HFBucketStore = Any


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
    try:  # in this thread, right before the batch: the window is this answer's way back
        found = store._client.paths_info(paths, deadline)
    except StoreError as e:
        return [VersionedDelete(n, error=e) for n in names]
    now = {p: found.get(p) for p in paths}
    out: dict[str, VersionedDelete] = {}
    doomed: list[str] = []
    for n, p, v in zip(names, paths, versions, strict=True):
        f = now[p]
        if f is None:
            out[p] = VersionedDelete(n)
        elif f.xet_hash != v:
            out[p] = VersionedDelete(n, changed=True)
        elif p not in out:
            out[p] = VersionedDelete(n, removed=True)
            doomed.append(p)
    store._cache.written(doomed)
    for i in range(0, len(doomed), HUB_BATCH_LIMIT):
        chunk = doomed[i : i + HUB_BATCH_LIMIT]
        failed = store._delete_batch(chunk, deadline)
        for p in chunk:
            if p in failed:
                out[p] = VersionedDelete(out[p].name, error=failed[p])
        store._cache.set_written((p, None) for p in chunk if p not in failed)
        store._cache.written(failed)
    return [out[p] for p in paths]


__all__ = ["delete_versions", "get_versions"]
