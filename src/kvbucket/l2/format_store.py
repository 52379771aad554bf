"""One store, two object formats: kvbucket's sealed chunks and LMCache's raw ones.

Objects under kvbucket's names go through the :class:`~kvbucket.stores.guard.sealed.SealedStore`
(envelope on write, verification on read). Objects under LMCache's names (see
:mod:`kvbucket.l2.naming`) go to the raw store underneath: LMCache 0.5.6 writes raw chunk bytes
and reads them back raw, so a bucket shared with LMCache nodes keeps exactly LMCache's bytes
there, and a load of such an object is served only when its size is exactly the caller's
buffer (the raw store's size check). The sealed store's ``unsealed`` policy therefore applies
to kvbucket's names only: an unsealed object under a kvbucket name is still a miss by default.

With encryption on, only encrypted chunks are served (docs/integrity.md, "What a reader may
delete"): LMCache's names hold plaintext, so they are not listed, never a lookup hit, and a load
of one is a miss counted as ``lmcache`` and left in place (:class:`_Unserved`), unless the
operator chose ``"unsealed": "accept"``. Writing LMCache's format with encryption on is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvbucket.envelope import EnvelopeError
from kvbucket.errors import ConfigError, StoreError
from kvbucket.l2.naming import Naming
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, VersionedDelete
from kvbucket.stores.guard.sealed import SealedStore


class _Unserved(ObjectStore):
    """LMCache's names while encryption is on: nothing is served or listed, a load of an object
    that exists is refused (``lmcache``) through the sealed store's one rule, which keeps it."""

    def __init__(self, sealed: SealedStore) -> None:
        self.sealed = sealed
        self.url = sealed.url

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        err = StoreError("LMCache's format is plaintext and is not written while encryption is on")
        return [ItemResult(n, error=err) for n, _ in items]

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        heads = self.sealed.inner.head_many(names)  # count (and log) only objects that exist
        bad = [(h.name, EnvelopeError("lmcache", f"{h.name}: LMCache's plaintext format, not served while "
                                                 "encryption is on"))
               for h in heads if h.found]
        if bad:
            self.sealed.refusals.refuse(self.sealed.inner, bad)
        return [h if h.error is not None else ItemResult(h.name) for h in heads]

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return [ItemResult(n) for n in names]  # nothing under these names can be loaded

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.sealed.inner.delete_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return iter(())


class FormatStore(ObjectStore):
    """Routes each name to the sealed store or, for LMCache's names, to the raw store."""

    def __init__(self, sealed: SealedStore, is_raw: Callable[[str], bool]) -> None:
        self.sealed = sealed
        self.raw = sealed.inner
        self.url = sealed.url
        self._is_raw = is_raw
        # Where LMCache's names go: the raw store, or nothing served while encryption is on.
        self.serves_lmcache = sealed.keyring is None or sealed.unsealed == "accept"
        self._lm: ObjectStore = self.raw if self.serves_lmcache else _Unserved(sealed)

    def __getattr__(self, name: str) -> Any:
        if name in ("sealed", "raw", "_lm"):
            raise AttributeError(name)
        return getattr(self.sealed, name)

    def __repr__(self) -> str:
        return f"FormatStore({self.sealed!r})"

    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        return self.raw.get_versions(names)  # both formats live in the raw store

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        return self.raw.delete_versions(items)

    def _split(self, names: Sequence[str]) -> tuple[list[int], list[int]]:
        raw, sealed = [], []
        for i, n in enumerate(names):
            (raw if self._is_raw(n) else sealed).append(i)
        return raw, sealed

    def _route(
        self, names: Sequence[str], call: Callable[[ObjectStore, list[int]], list[ItemResult]]
    ) -> list[ItemResult]:
        raw, sealed = self._split(names)
        if not raw:
            return call(self.sealed, sealed)
        if not sealed:
            return call(self._lm, raw)
        # Both formats at once (each verb has its own time budget: in turn they would add up).
        box: dict[str, Any] = {}

        def raw_part() -> None:
            try:
                box["r"] = call(self._lm, raw)
            except BaseException as e:  # re-raised in the caller's thread
                box["e"] = e

        th = threading.Thread(target=raw_part, name="kvbucket-format-raw", daemon=True)
        th.start()
        sealed_results = call(self.sealed, sealed)
        th.join()
        if "e" in box:
            raise box["e"]
        out: list[ItemResult | None] = [None] * len(names)
        for idx, results in ((raw, box["r"]), (sealed, sealed_results)):
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        return self._route([n for n, _ in items], lambda s, idx: s.put_many([items[i] for i in idx]))

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        if out is None:
            return self._route(names, lambda s, idx: s.get_many([names[i] for i in idx]))
        return self._route(names, lambda s, idx: s.get_many([names[i] for i in idx], [out[i] for i in idx]))

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self._route(names, lambda s, idx: s.head_many([names[i] for i in idx]))

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self._route(names, lambda s, idx: s.delete_many([names[i] for i in idx]))

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        """One listing of the raw store; sizes are payload sizes in both formats."""
        for info in self.raw.list(prefix, page_size=page_size):
            if self._is_raw(info.name):
                if self.serves_lmcache:
                    yield info
            else:
                size = self.sealed.payload_size(info.size) or 0
                yield ObjectInfo(info.name, size, info.mtime, info.version)

    def close(self) -> None:
        self.sealed.close()


def route_formats(sealed: SealedStore, naming: Naming) -> ObjectStore:
    """``sealed`` itself when ``naming`` knows no LMCache format, else a :class:`FormatStore`."""
    if naming.writes_lmcache and sealed.keyring is not None:
        raise ConfigError(
            'object_format "lmcache" writes LMCache\'s plaintext chunks and cannot be encrypted: '
            'drop "encryption" or use object_format "kvbucket" (the default)'
        )
    if naming.style is None:
        return sealed
    return FormatStore(sealed, naming.is_lmcache_name)


__all__ = ["FormatStore", "route_formats"]
