"""What a node counts of its evictions holds however its rounds interleave with the deletes."""

from __future__ import annotations

import time

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.sync import Fleet
from kvbucket.keys import key_to_name
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.fleet_node import key

FAST = {"sync_secs": 0.05, "grace_secs": 0.0, "max_age_secs": 0.05, "reconcile_secs": 0.01}


def test_an_eviction_counts_by_the_writer_even_when_a_reconcile_drops_the_entry_first() -> None:
    """The victims are another node's; the compactor's reconcile lists them gone (this node's
    delete landed) before the host reports the delete. They still count as cross-node evictions,
    once each (CI under load: 4 of 8 counted)."""
    store = MemoryStore("counts")
    names = [key_to_name(key(i)) for i in range(4)]
    store.put_many([(n, b"kv" * 8) for n in names])
    old = Fleet(store, FleetConfig(node_id="z-old", **FAST))
    old.note_stored(names, [16] * 4)
    old.sync_once()  # its journal holds the four stores
    new = Fleet(store, FleetConfig(node_id="a-new", **FAST))  # the compactor (smallest live id)
    new.sync_once()
    assert set(new._state.view.entries) == set(names)
    time.sleep(0.2)  # past max_age and the reconcile's settling time
    new.sync_once()  # the horizon moves past the stores
    victims = new.victims(())
    assert sorted(victims) == sorted(names)
    assert all(r.ok for r in store.delete_many(victims))
    time.sleep(0.05)  # past reconcile_secs since the last reconcile
    new.sync_once()  # reconcile: the listing lacks them, HEAD confirms, the view drops them
    assert not new._state.view.entries
    new.note_deleted(victims, evicted=True)
    new.note_deleted(victims, evicted=True)  # told twice: counted once
    assert new.stats["evicted_cross_node"] == 4 and new.stats["evicted_own"] == 0
