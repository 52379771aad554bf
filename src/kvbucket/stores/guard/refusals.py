"""What a reader may delete: the one rule, for every tier and ``kvbucket verify``.

A bucket is shared by engines, tenants and machines that do not read alike. An object is removed
only when its bytes contradict their own envelope (:data:`DAMAGE`: a bad checksum, a truncation,
a length or header that disagrees with itself). An object that is intact but not for this
reader (:data:`UNREADABLE`: written under another relative name or prefix, for another model or
KV layout, under a key id its keyring lacks or another tenant's key, no keyring, a newer format,
no envelope, a plaintext object or LMCache's raw format while encryption is on) is a miss that
is counted and left in place: it may be valid for its writer. A name proves nothing on its own:
a reader whose root is one level above or below the writer's sees every intact chunk under
another name. The disk tier, whose directory no other reader uses, keeps such files too, in its
byte bound, and evicts them first (:mod:`kvbucket.backends.local_disk`). docs/integrity.md,
"What a reader may delete".

Every refusal of a load goes through :meth:`Refusals.refuse` (counted, logged once, removed by
:func:`removable`); ``kvbucket verify --delete-bad`` asks :func:`removable` too.

A removal names the version judged, and damage is seen twice before it counts as damage in
storage (:func:`judge_again`): the object is read again afresh (:meth:`ObjectStore.get_versions`:
a new connection, a new reconstruction), judged again, and removed only when that read is damaged
too, by :meth:`ObjectStore.delete_versions` naming the version of the bytes judged. A re-read that
verifies (the damage was on the wire, or the object was written since) is kept and served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from kvbucket import envelope as env
from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult, VersionedDelete

if TYPE_CHECKING:
    from kvbucket.stores.base import ObjectStore

#: Opens one object read whole (an envelope opener's ``_open_whole``): its verified result, or
#: :class:`~kvbucket.envelope.EnvelopeError` with the reason.
Judge = Callable[[str, Any], "ItemResult"]

log = logging.getLogger(__name__)

#: Reasons that the object's own bytes prove it damaged: the object is removed.
DAMAGE = frozenset({"checksum", "truncated", "length", "header"})
#: Not for this reader (it cannot open the object; others may): counted, kept.
UNREADABLE = frozenset(env.REASONS) - DAMAGE

INTEGRITY_FAILURES = Counter(
    "kvbucket_integrity_failures",
    "Stored objects refused on read (served as a miss), by tier and reason (damage: checksum, "
    "truncated, length, header, removed; not for this reader: name, unsealed, version, identity, "
    "no_keyring, key, plaintext, decrypt, lmcache, kept).",
    ["tier", "reason"],
)
INTEGRITY_REMOVED = Counter(
    "kvbucket_integrity_removed",
    "Refused objects removed from the store (damaged: their bytes contradict their envelope), by tier "
    "and reason.",
    ["tier", "reason"],
)
INTEGRITY_REREADS = Counter(
    "kvbucket_integrity_rereads",
    "Objects refused as damaged and read again afresh before any removal, by tier and outcome: damaged "
    "(seen twice: damage in storage, removed by version), intact (not seen again: damage on the wire, "
    "or written since; kept and served), failed (the re-read failed: kept).",
    ["tier", "outcome"],
)
DELETES_KEPT = Counter(
    "kvbucket_deletes_kept_changed",
    "Deletes kvbucket decided on its own that found the object written since it was judged (another "
    "version): kept, by path (refusal, eviction, fleet_eviction, verify, rm).",
    ["path"],
)
INTEGRITY_VERIFIED = Counter(
    "kvbucket_integrity_verified",
    "Stored objects whose envelope verified on read before the caller got them, by tier.",
    ["tier"],
)
_LOGGED_MAX = 10000
_KEPT_HINT = {
    "name": "written under another name: by a writer whose store root or prefix differs from this "
            "reader's (give both the same URL and prefix), or copied/renamed",
    "unsealed": "no kvbucket envelope (another program's, or written before sealing)",
    "version": "an envelope format this kvbucket does not read (a newer writer?)",
    "identity": "written for another model or KV layout",
    "no_keyring": "encrypted, and this reader has no keyring (set the tier's encryption setting)",
    "key": "encrypted under a key id this reader's keyring lacks (retired, or another tenant's)",
    "plaintext": "not encrypted, and this reader's encryption is on",
    "decrypt": "does not authenticate under this reader's key (another tenant's key, or tampered)",
    "lmcache": "LMCache's raw format, never served while encryption is on",
}


def removable(reason: str) -> bool:
    """Whether an object refused for ``reason`` is removed: only when its bytes contradict their
    own envelope (see the module docstring)."""
    return reason in DAMAGE


def delete_judged(store: ObjectStore, items: Sequence[tuple[str, str]], path: str) -> list[VersionedDelete]:
    """``store.delete_versions(items)``, counting the objects written since their judgement
    (kept) under ``path`` in ``kvbucket_deletes_kept_changed_total``. Every delete kvbucket makes on
    its own initiative goes through here."""
    if not items:
        return []
    out = store.delete_versions(items)
    changed = sum(1 for r in out if r.changed)
    if changed:
        DELETES_KEPT.labels(path).inc(changed)
        log.info("%d object(s) of %s were written since they were judged (%s): kept", changed,
                 getattr(store, "url", store), path)
    return out


def delete_as_seen(store: ObjectStore, names: Sequence[str], versions: dict[str, str | None], path: str
                   ) -> dict[str, VersionedDelete | ItemResult]:
    """Eviction's delete: each name by the version its judgement saw (``versions``), or where that
    is unknown, by the version a HEAD sees now (a write before that HEAD and after the judgement
    is the window left: docs/integrity.md); a name that HEAD finds gone is not deleted (a write
    may come between), and only names a store gives no version for (a store that found them) are
    removed as they are. Name -> outcome (a :class:`VersionedDelete`, or ``delete_many``'s result)."""
    versions = dict(versions)
    out: dict[str, VersionedDelete | ItemResult] = {}
    if unknown := [n for n in names if not versions.get(n)]:
        for h in store.head_many(unknown):
            if h.found:
                versions[h.name] = h.version
            else:  # gone already, or the HEAD failed: never a delete by name (a writer may be next)
                out[h.name] = ItemResult(h.name, error=h.error) if h.error else VersionedDelete(h.name)
    known = [(n, str(versions[n])) for n in names if versions.get(n)]
    plain = [n for n in names if not versions.get(n) and n not in out]
    out.update((d.name, d) for d in delete_judged(store, known, path))
    if plain:
        out.update((r.name, r) for r in store.delete_many(plain))
    return out


def judge_again(store: ObjectStore, names: Sequence[str], judge: Judge, tier: str
                ) -> tuple[dict[str, ItemResult], list[tuple[str, str, str]]]:
    """Read ``names`` again afresh and judge them again: (the names that verified now -> their
    verified results, the (name, version, reason) of those damaged again). Counted in
    ``kvbucket_integrity_rereads_total``; a failed re-read, a miss, or a refusal not for damage
    (another writer's version) appear in neither."""
    good: dict[str, ItemResult] = {}
    damaged: list[tuple[str, str, str]] = []
    for r in store.get_versions(names):
        if r.error is not None or r.size is None or r.version is None:
            if r.error is not None:
                INTEGRITY_REREADS.labels(tier, "failed").inc()
                log.warning("integrity: %s could not be read again to confirm its damage (%s); kept",
                            r.name, r.error)
            continue
        try:
            good[r.name] = judge(r.name, r.data)
        except env.EnvelopeError as e:
            if removable(e.reason):
                INTEGRITY_REREADS.labels(tier, "damaged").inc()
                damaged.append((r.name, r.version, e.reason))
            continue
        INTEGRITY_REREADS.labels(tier, "intact").inc()
        log.warning("integrity: %s was damaged when read but intact when read again (damage on the wire, "
                    "or written since): kept", r.name)
    return good, damaged


class Refusals:
    """Counts, logs and removes (or keeps) the objects one store refused, by the one rule."""

    def __init__(self, tier: str, url: str, judge: Judge | None = None) -> None:
        self.tier = tier
        self.url = url
        self.judge = judge
        self._logged: set[str] = set()
        self._kept_reasons: set[str] = set()
        self._lock = threading.Lock()

    def _first(self, name: str, reason: str) -> tuple[bool, bool]:
        """(first refusal of this object, first object kept for this reason)."""
        with self._lock:
            first = name not in self._logged
            if first:
                if len(self._logged) >= _LOGGED_MAX:
                    self._logged.clear()
                self._logged.add(name)
            first_reason = reason not in self._kept_reasons
            self._kept_reasons.add(reason)
        return first, first_reason

    def refuse(self, store: ObjectStore, bad: Sequence[tuple[str, env.EnvelopeError]]
               ) -> dict[str, ItemResult]:
        """Count every refusal of ``bad`` (objects of ``store``); read again those :func:`removable`
        and remove the ones damaged again, by version. Returns the objects that verified when read
        again (name -> verified result), which the load serves.

        A damaged object is logged once at WARNING; objects kept for a reason of this reader's own
        are logged at WARNING once per reason (with the fix), then at DEBUG: one misconfigured
        node reading a whole bucket says it once, not once per chunk.
        """
        drop: list[str] = []
        for name, e in bad:
            INTEGRITY_FAILURES.labels(self.tier, e.reason).inc()
            deleting = removable(e.reason)
            first, first_reason = self._first(name, e.reason)
            if deleting:
                drop.append(name)
                if first:
                    log.warning("integrity: %s refused on tier %s (%s, %s): %s; treated as a miss, read "
                                "again and removed if damaged again", name, self.tier, self.url, e.reason, e)
            elif first_reason:
                log.warning("integrity: %s refused on tier %s (%s, %s: %s); a miss, left in place for the "
                            "readers that can open it. Further objects refused for %r here are counted "
                            "(kvbucket_integrity_failures_total) and logged at DEBUG", name, self.tier,
                            self.url, e.reason, _KEPT_HINT.get(e.reason, e.reason), e.reason)
            elif first:
                log.debug("integrity: %s refused on tier %s (%s): %s; left in place", name, self.tier,
                          e.reason, e)
        if not drop or self.judge is None:
            return {}
        try:
            return self._remove(store, list(dict.fromkeys(drop)), self.judge)
        except StoreError as e:
            log.warning("integrity: could not remove %d refused objects from %s: %s", len(drop), self.url, e)
            return {}

    def _remove(self, store: ObjectStore, drop: list[str], judge: Judge) -> dict[str, ItemResult]:
        good, damaged = judge_again(store, drop, judge, self.tier)
        reasons = {n: reason for n, _, reason in damaged}
        for r in delete_judged(store, [(n, v) for n, v, _ in damaged], "refusal"):
            if r.error is not None:
                log.warning("integrity: could not remove refused %s from %s: %s", r.name, self.url, r.error)
            elif r.removed:
                INTEGRITY_REMOVED.labels(self.tier, reasons[r.name]).inc()
        return good


__all__ = [
    "DAMAGE",
    "DELETES_KEPT",
    "INTEGRITY_FAILURES",
    "INTEGRITY_REMOVED",
    "INTEGRITY_REREADS",
    "INTEGRITY_VERIFIED",
    "UNREADABLE",
    "Refusals",
    "delete_as_seen",
    "delete_judged",
    "judge_again",
    "removable",
]
