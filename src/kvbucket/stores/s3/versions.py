"""Versions of S3 objects: the ETag, read afresh, and deletes that name it.

``get_versions`` reads each object through a new client (a new connection pool: whatever went
wrong on the connection of the first read, a proxy, a body left on a kept-alive connection, is
not met again), keeping the ETag of the bytes read. ``delete_versions`` compares the current ETag
(a HEAD) and then sends ``DELETE`` with ``If-Match: <ETag>`` (AWS, Ceph and SeaweedFS answer 412
when the object changed meanwhile): a 412 is "someone wrote it since", kept. Where the request
cannot carry the condition (no direct reader: a proxy, HTTP/2, S3 Express) or the server answers
that it does not support it (501, 400 ``NotImplemented``), the delete follows the HEAD without a
condition: a writer finishing between that HEAD and the DELETE (one round trip) loses its object.
An ETag names content (the MD5 of a single-part upload): a rewrite of the very same bytes is the
same version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import obstore

from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult, VersionedDelete
from kvbucket.stores.s3.client import build_client

# ``store`` below is an S3Store (not imported: the store imports this module).
S3Store = Any

_UNSUPPORTED = {400, 501}


def get_versions(store: S3Store, names: Sequence[str]) -> list[ItemResult]:
    """Whole objects with their ETags, through a client of their own (see the module docstring)."""
    if not names:
        return []
    fresh = build_client(store.config, store.target)
    out = []
    for n in names:
        try:
            result = obstore.get(fresh, n)
            data = bytes(result.bytes())
        except Exception as e:
            out.append(store._missing_or_error(e, "get", n))
            continue
        out.append(ItemResult(n, size=len(data), data=data, version=result.meta.get("e_tag")))
    return out


def delete_versions(store: S3Store, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
    """Each item's HEAD and conditional DELETE, the items concurrently on the store's pool."""
    if len(items) < 2:
        return [_delete_one(store, n, etag) for n, etag in items]
    futures = [store._pool.submit(_delete_one, store, n, etag) for n, etag in items]
    out = []
    for (n, _), f in zip(items, futures, strict=True):
        try:
            out.append(f.result())
        except Exception as e:  # the pool shut down (the store closed): kept
            out.append(VersionedDelete(n, error=StoreError(f"S3 delete of {n!r} did not run: {e}")))
    return out


def _delete_one(store: S3Store, name: str, etag: str) -> VersionedDelete:
    try:
        now = obstore.head(store._store, name).get("e_tag")
    except Exception as e:
        r = store._missing_or_error(e, "head", name)
        return VersionedDelete(name, error=r.error)
    if now != etag:
        return VersionedDelete(name, changed=True)
    direct = store._direct
    if direct is not None and (urls := direct.sign([name], "DELETE")) is not None:
        try:
            status = direct.conditional("DELETE", urls[0], etag)
        except Exception as e:
            return VersionedDelete(name, error=StoreError(
                f"S3 delete of {store._where(name)} did not complete ({type(e).__name__}); kept"))
        if status in (200, 204):
            return VersionedDelete(name, removed=True)
        if status == 412:
            return VersionedDelete(name, changed=True)
        if status == 404:
            return VersionedDelete(name)
        if status not in _UNSUPPORTED:
            return VersionedDelete(name, error=StoreError(
                f"S3 delete of {store._where(name)} answered HTTP {status}; kept"))
    try:  # no condition could be sent: the HEAD above was the check (the window is documented)
        obstore.delete(store._store, name)
    except Exception as e:
        r = store._missing_or_error(e, "delete", name)
        return VersionedDelete(name, error=r.error)
    return VersionedDelete(name, removed=True)


__all__ = ["delete_versions", "get_versions"]
