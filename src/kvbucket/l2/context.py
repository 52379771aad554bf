"""What every path of :class:`~kvbucket.l2.adapter.ObjectStoreL2Adapter` is handed.

The adapter builds one :class:`AdapterContext` and hands it to each path (store, lookup, load,
removal, inventory); a path keeps its own state (its completions, ``evicting``) and reaches the
shared parts through it. The context holds references only: what guards each part is said where
the part is defined (:class:`~kvbucket.l2.state.KeyState` and its one lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbucket.l2.core import Listeners, NameCache, Stats
from kvbucket.l2.state import KeyState
from kvbucket.l2.tasks import TaskRunner
from kvbucket.stores.base import ObjectStore

if TYPE_CHECKING:
    from kvbucket.fleet.host import FleetLink


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """The adapter's shared parts, built once."""

    state: KeyState  # the keys the adapter knows, and the lock that guards them
    names: NameCache  # the names each key is written and read under
    runner: TaskRunner  # the loop thread and the store-call pool
    store: ObjectStore  # sealed, routed by name format, behind the read-ahead buffer when it is on
    stats: Stats  # the counters report_status shows
    listeners: Listeners  # LMCache's listener, told of stored, accessed and deleted keys
    fleet: FleetLink | None  # the fleet on this prefix (None: this node alone)

    @property
    def prefix(self) -> str:
        return self.names.naming.prefix
