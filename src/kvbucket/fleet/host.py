"""How an L2 adapter takes part in a fleet, through a narrow interface.

The adapter tells :class:`FleetLink` what it stored, accessed and deleted, and asks it for
eviction victims; the link mirrors what the other nodes did into the adapter's
:class:`~kvbucket.l2.accounting.KeyIndex` (so ``get_usage()`` and lookups see the whole fleet)
and wakes the adapter's eviction after every sync round.

Lock order: the adapter's lock may be held while calling into the fleet (which takes its own
lock); the fleet never calls back while holding its lock, so the two cannot deadlock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

from kvbucket.fleet import gauges
from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.fleet.view import Change, key_of
from kvbucket.keys import ObjectKey

if TYPE_CHECKING:
    from kvbucket.l2.adapter import ObjectStoreL2Adapter


class FleetLink:
    def __init__(self, adapter: ObjectStoreL2Adapter, config: FleetConfig) -> None:
        self._adapter = adapter
        sealed = adapter.store  # chunks are sealed (kvbucket.stores.sealed); fleet objects are not
        self.fleet = Fleet(
            getattr(sealed, "inner", sealed),
            config,
            chunk_store=sealed,
            parse=adapter.naming.parse,
            prefix=adapter._prefix,
            capacity=adapter._capacity,
            eviction=adapter._eviction,
            on_changes=self._apply,
            on_tick=self._tick,
            on_ready=self._ready,
        )
        self.fleet.start()
        gauges.track(self.fleet, sealed.url, adapter._capacity)  # kvbucket stats shows its usage

    # ---- adapter -> fleet -----------------------------------------------------------------
    def stored(self, names: Iterable[str], sizes: Iterable[int]) -> None:
        self.fleet.note_stored(names, sizes)

    def accessed(self, names: Iterable[str]) -> None:
        self.fleet.note_accessed(names)

    def deleted(self, names: Iterable[str], *, evicted: bool = False) -> None:
        self.fleet.note_deleted(names, evicted=evicted)

    def admit(self, sizes: list[int]) -> int:
        return self.fleet.admit(sizes)

    def victims(self, busy: Container[str]) -> list[str]:
        return self.fleet.victims(busy)

    def has_expired(self) -> bool:
        return self.fleet.has_expired()

    def status(self) -> dict[str, Any]:
        return self.fleet.status()

    def close(self) -> None:
        gauges.forget(self.fleet)
        self.fleet.close()

    # ---- fleet -> adapter ---------------------------------------------------------------------
    def _apply(self, changes: list[Change]) -> None:
        a = self._adapter
        added: list[tuple[ObjectKey, int]] = []
        gone: list[tuple[ObjectKey, int]] = []
        with a._lock:
            for name, size in changes:
                if name in a._deleting:
                    continue
                if size is None:
                    entry = a._index.get(name)
                    if entry is not None and a._index.remove(name):
                        gone.append((entry.key, entry.size))
                    continue
                key = key_of(name, a._prefix) or a.naming.parse(name)
                if key is None:
                    continue
                was_new = name not in a._index
                a._index.add(name, key, size, touch=False)
                a._missing.pop(name, None)
                if a._full_fixed is None:
                    group = key.kv_rank >> 32
                    a._full[group] = max(a._full.get(group, 0), size)
                if was_new:
                    added.append((key, size))
        listener = a.listener
        if listener is not None:
            if added:
                listener.on_keys_stored([k for k, _ in added], [s for _, s in added])
            if gone:
                listener.on_keys_deleted([k for k, _ in gone], [s for _, s in gone])

    def _tick(self) -> None:
        a = self._adapter
        if not a.closed:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                a._loop.call_soon_threadsafe(a._maybe_evict)

    def _ready(self) -> None:
        with self._adapter._lock:
            self._adapter._rebuilt = True


__all__ = ["FleetLink"]
