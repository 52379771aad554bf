"""What an L2 adapter knows about the keys in its store, and the one lock that guards it.

Every attribute of :class:`KeyState` but ``full_fixed`` is read and written with ``lock`` held
(a bare read of ``closed`` or ``rebuilt`` outside it is a hint, re-checked under the lock where
it matters). The paths (:mod:`~kvbucket.l2.store_path`, :mod:`~kvbucket.l2.lookup_path`,
:mod:`~kvbucket.l2.load_path`, :mod:`~kvbucket.l2.removal`, :mod:`~kvbucket.l2.inventory`) are
handed this object; each keeps its own results elsewhere (:class:`~kvbucket.l2.tasks.Completions`).

Lock order: ``lock`` may be held while calling into a fleet (which takes its own lock) or
scheduling a task on the loop; never while waiting for the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from kvbucket.keys import ObjectKey
from kvbucket.l2.accounting import KeyIndex


class KeyState:
    """See the module docstring."""

    def __init__(self, *, full_chunk_bytes: int | None, rebuilt: bool) -> None:
        self.lock = threading.Lock()
        # What the store holds, by name: sizes, bytes per salt, recency (usage and eviction).
        self.index = KeyIndex()
        self.key_locks: dict[str, int] = {}  # name -> count of lookup hits not yet unlocked
        self.deleting: set[str] = set()  # names a delete or eviction is removing
        # Names a store task is writing -> count: the startup listing leaves them to the task,
        # which reports them to the listener as stored.
        self.storing: dict[str, int] = {}
        self.missing: dict[str, float] = {}  # name -> monotonic expiry of a remembered miss
        # Names LMCache unlocked without loading them from this adapter (read-ahead wasted: held
        # in its L1 or loaded from another adapter); their lookups start no read-ahead until a
        # load of theirs comes. Oldest first, at most NOT_LOADED_LIMIT (lookup_path).
        self.not_loaded: OrderedDict[str, None] = OrderedDict()
        # Full chunk size: fixed by config, or learnt per object group (kv_rank >> 32, see
        # kvbucket.integrations.lmcache) from lookups' layouts and the fleet.
        self.full_fixed = full_chunk_bytes
        self.full: dict[int, int] = {}
        self.closed = False
        self.rebuilt = rebuilt  # the startup listing (or the fleet's first view) is in the index
        self.deleted_while_rebuilding: set[str] = set()

    def forget(self, name: str) -> int:
        """Drop ``name`` from the index, for good: the store no longer holds it (deleted, evicted,
        found gone) or holds bytes this reader must not serve (refused and kept). The startup
        listing, if still running, must not add it back from a page it read earlier. Returns the
        indexed size (0: not indexed). Call with ``lock``."""
        if not self.rebuilt:
            self.deleted_while_rebuilding.add(name)
        return self.index.remove(name)

    def where(self, cands: tuple[str, ...]) -> str | None:
        """The first candidate name the index holds (call with ``lock``)."""
        for c in cands:
            if c in self.index:
                return c
        return None

    def full_size(self, key: ObjectKey) -> int | None:
        """The size a hit for ``key`` must have, when known (call with ``lock``)."""
        return self.full_fixed if self.full_fixed is not None else self.full.get(key.kv_rank >> 32)

    def mark_storing(self, names: Iterable[str]) -> None:
        """Call with ``lock``."""
        for nm in names:
            self.storing[nm] = self.storing.get(nm, 0) + 1

    def unmark_storing(self, names: Iterable[str]) -> None:
        """Call with ``lock``."""
        for nm in names:
            c = self.storing.get(nm, 0)
            if c <= 1:
                self.storing.pop(nm, None)
            else:
                self.storing[nm] = c - 1
