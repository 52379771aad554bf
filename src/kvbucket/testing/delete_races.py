"""Races between a delete kvbucket decides on its own and a writer storing a new version.

"A delete names the version it judged" (docs/integrity.md) is checked two ways, over any store:

- :func:`refusal_race`: no hook. A reader loads a damaged v1 of a name (so it refuses it and
  removes it) while a writer stores a valid v2 of that name at a random moment 0-4 ms after the
  load starts; the trial loses v2 when the name no longer holds it afterwards.
- :class:`HookedStore`: a forced interleaving. It runs a hook (a writer storing a new version)
  right before the first delete that reaches the store, i.e. between the judgement and the
  delete of whatever path decided it; the new version must survive.

``benchmarks/delete_races.py`` runs the no-hook race 300 times per store kind. A v2 missing right
after a trial is counted (``lost_before_recheck``: on the Hub, a delete that took it in the
window between its compare and its batch), then checked again after the writer's re-check ran
(:func:`settle_writes`); ``lost`` is what stays lost.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbucket import envelope as env
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, VersionedDelete
from kvbucket.stores.guard.sealed import SealedStore, seal_store


class HookedStore(ObjectStore):
    """``inner``, with ``hook(names)`` run once before the first delete of names ``only`` accepts
    (default: any) reaches it."""

    def __init__(self, inner: ObjectStore, hook: Callable[[list[str]], Any],
                 only: Callable[[str], bool] | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.hook: Callable[[list[str]], Any] | None = hook
        self.only = only
        self.hooked: list[str] = []  # the names the hook ran before

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _before(self, names: list[str]) -> None:
        names = [n for n in names if self.only is None or self.only(n)]
        if not names or self.hook is None:
            return
        hook, self.hook = self.hook, None
        self.hooked = names
        hook(names)

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        return self.inner.put_many(items)

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        return self.inner.get_many(names, out)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.head_many(names)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        self._before(list(names))
        return self.inner.delete_many(names)

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        self._before([n for n, _ in items])
        return self.inner.delete_versions(items)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, page_size=page_size)

    def close(self) -> None:
        self.inner.close()


class WireDamage(ObjectStore):
    """``inner`` behind a bad wire: each object read by ``get_many`` has one bit flipped, with
    probability ``rate``, before it lands in the reader's buffer (so the checksum a load feeds as
    bytes land sees it, as it would see a flip in transit). ``get_versions`` (the fresh re-read of
    a refusal) goes straight to ``inner``: a new connection does not meet the damage again."""

    def __init__(self, inner: ObjectStore, rate: float, seed: int = 0) -> None:
        self.inner = inner
        self.url = inner.url
        self.rate = rate
        self.flipped = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "get_each", "read_prefixes"):  # reads that would bypass the wire
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _maybe_flip(self, data: Any) -> Any:
        with self._lock:
            flip = self._rng.random() < self.rate
            at = self._rng.random()
        if not flip or not len(data):
            return data
        out = bytearray(data)
        out[int(at * len(out))] ^= 0x10
        with self._lock:
            self.flipped += 1
        return out

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        from kvbucket.errors import StoreError
        from kvbucket.stores.base import check_buffer_size

        results = []
        for i, r in enumerate(self.inner.get_many(names)):
            if not r.found:
                results.append(r)
                continue
            data = self._maybe_flip(r.data)
            buf = out[i] if out is not None else None
            if buf is None:
                results.append(ItemResult(r.name, size=len(data), data=data))
                continue
            try:
                view = check_buffer_size(r.name, len(data), buf)
                view[0 : len(data)] = data
            except StoreError as e:
                results.append(ItemResult(r.name, error=e))
                continue
            results.append(ItemResult(r.name, size=len(data), data=buf))
        return results

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        return self.inner.put_many(items)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.head_many(names)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.delete_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, page_size=page_size)


def damage(raw: ObjectStore, name: str, offset: int | None = None) -> None:
    """Flip one payload byte of the sealed object ``name`` in storage (damage at rest)."""
    data = bytearray(raw.get(name) or b"")
    if len(data) <= env.HEADER_SIZE:
        raise ValueError(f"{name!r} holds no sealed payload to damage")
    at = offset if offset is not None else env.HEADER_SIZE + (len(data) - env.HEADER_SIZE) // 2
    data[at] ^= 0x01
    raw.put(name, data)


@dataclass
class RaceReport:
    """What :func:`refusal_race` saw: trials, valid rewrites lost, and how the load ended."""

    trials: int = 0
    lost: int = 0  # after the writer's re-check (a Hub writer adds back what a racing delete took)
    lost_before_recheck: int = 0  # right after the trial: the deletes that did take v2
    served_new: int = 0  # the load served v2 (it read or re-read after the write)
    missed: int = 0  # the load was a miss (it judged v1 damaged)
    lost_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"trials": self.trials, "lost": self.lost, "lost_before_recheck": self.lost_before_recheck,
                "served_new": self.served_new, "missed": self.missed}


def refusal_race(open_raw: Callable[[], ObjectStore], trials: int, *, seed: int = 0, size: int = 4096,
                 max_delay: float = 0.004, prefix: str = "race") -> RaceReport:
    """``trials`` no-hook races (see the module docstring) over stores ``open_raw()`` opens on one
    place: the reader, the writer and the checker each have their own."""
    rng = random.Random(seed)
    raw_w, raw_r, raw_c = open_raw(), open_raw(), open_raw()
    writer = seal_store(raw_w, tier="race-writer", identity="race")
    reader = seal_store(raw_r, tier="race-reader", identity="race")
    checker = seal_store(raw_c, tier="race-check", identity="race")
    report = RaceReport()
    try:
        for t in range(trials):
            name = f"{prefix}/{seed}-{t}"
            v1, v2 = rng.randbytes(size), rng.randbytes(size)
            writer.put(name, v1)
            damage(raw_w, name)
            delay = rng.uniform(0.0, max_delay)
            start = threading.Barrier(2)
            got: list[ItemResult] = []

            def load(start: threading.Barrier = start, got: list[ItemResult] = got, name: str = name) -> None:
                start.wait()
                got.extend(reader.get_many([name]))

            th = threading.Thread(target=load, daemon=True)
            th.start()
            start.wait()
            time.sleep(delay)
            writer.put(name, v2)
            th.join(60)
            report.trials += 1
            if got and got[0].found:
                report.served_new += bytes(got[0].data) == v2
            else:
                report.missed += 1
            now = checker.get(name)
            if now != v2:
                report.lost_before_recheck += 1
                settle_writes(raw_w)
                now = checker.get(name)
            if now != v2:
                report.lost += 1
                report.lost_names.append(name)
            raw_w.delete_many([name])
    finally:
        for s in (raw_w, raw_r, raw_c):
            s.close()
    return report


def settle_writes(store: ObjectStore, timeout: float | None = None) -> int:
    """Run the writer-side re-checks ``store`` has pending (a Hub store: stores/hub/rechecks.py),
    waiting until they are due; other stores have none (0)."""
    rechecks = getattr(store, "rechecks", None)
    return 0 if rechecks is None else int(rechecks.settle(timeout))


def sealed_pair(open_raw: Callable[[], ObjectStore], hook: Callable[[list[str]], Any]
                ) -> tuple[SealedStore, HookedStore, SealedStore]:
    """(a reader whose store runs ``hook`` before its first delete, that hooked store, a writer)."""
    hooked = HookedStore(open_raw(), hook)
    return (seal_store(hooked, tier="hooked-reader", identity="race"), hooked,
            seal_store(open_raw(), tier="hooked-writer", identity="race"))


__all__ = ["HookedStore", "RaceReport", "WireDamage", "damage", "refusal_race", "sealed_pair",
           "settle_writes"]
