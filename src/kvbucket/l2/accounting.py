"""What an adapter holds: object sizes by name, bytes per cache salt, and recency order.

The index is the adapter's only source for ``get_usage()`` and eviction, so it changes only on
facts: a put the store confirmed, a head/list that found an object, a delete or a load miss
that showed an object is gone. Keys are tracked by object name, so storing a key twice never
counts it twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvbucket.keys import ObjectKey


@dataclass(slots=True)
class Entry:
    key: ObjectKey
    size: int
    version: str | None = None  # as the put, head or listing saw it: what eviction deletes


class KeyIndex:
    """Not thread-safe: the adapter guards it with its lock."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        # Least recently stored-or-accessed first; one order per salt and one overall.
        self._order: OrderedDict[str, None] = OrderedDict()
        self._order_by_salt: dict[str, OrderedDict[str, None]] = {}
        self._bytes_by_salt: dict[str, int] = {}
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def add(self, name: str, key: ObjectKey, size: int, *, touch: bool = True,
            version: str | None = None) -> int:
        """Record that ``name`` holds ``size`` bytes (of ``version``, None: unknown); returns the
        change in bytes used.

        ``touch=False`` records an object found by a listing without making it recent (it goes
        to the old end, so objects from before a restart are evicted before fresh ones).
        """
        old = self._entries.get(name)
        delta = size - (old.size if old else 0)
        salt = key.cache_salt
        if old is None:
            self._entries[name] = Entry(key, size, version)
            order = self._order_by_salt.setdefault(salt, OrderedDict())
            self._order[name] = None
            order[name] = None
            if not touch:
                self._order.move_to_end(name, last=False)
                order.move_to_end(name, last=False)
        else:
            old.size = size
            old.version = version
            if touch:
                self.touch(name)
        self.bytes_used += delta
        self._bytes_by_salt[salt] = self._bytes_by_salt.get(salt, 0) + delta
        return delta

    def remove(self, name: str) -> int:
        """Forget ``name``; returns the bytes it held (0 when unknown)."""
        old = self._entries.pop(name, None)
        if old is None:
            return 0
        salt = old.key.cache_salt
        self._order.pop(name, None)
        order = self._order_by_salt.get(salt)
        if order is not None:
            order.pop(name, None)
            if not order:
                del self._order_by_salt[salt]
        self.bytes_used -= old.size
        left = self._bytes_by_salt.get(salt, 0) - old.size
        if left > 0:
            self._bytes_by_salt[salt] = left
        else:
            self._bytes_by_salt.pop(salt, None)
        return old.size

    def touch(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        self._order.move_to_end(name)
        self._order_by_salt[entry.key.cache_salt].move_to_end(name)

    def bytes_by_salt(self) -> dict[str, int]:
        return {s: b for s, b in self._bytes_by_salt.items() if b > 0}

    def oldest(self, salt: str | None = None) -> list[str]:
        """Names, least recently used first (of one salt, or of all)."""
        order = self._order if salt is None else self._order_by_salt.get(salt, OrderedDict())
        return list(order)

    def names(self) -> list[str]:
        return list(self._entries)


__all__ = ["Entry", "KeyIndex"]
