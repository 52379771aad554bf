"""Old identities are garbage: in a fleet, the chunks of an identity no live node uses age out
under ``max_age_secs`` (removed by a live node of another identity), and that node never served
them meanwhile."""

from __future__ import annotations

from kvbucket.fleet.config import FleetConfig
from kvbucket.identity.core import IdentitySetting
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.l2.naming import Naming
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing import l2 as t
from kvbucket.testing.fleet_node import chunk, key, until

CHUNK = 1024
FLEET = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 0.5,
         "grace_secs": 0.0, "max_age_secs": 1.0}


def node(store: MemoryStore, name: str, identity: str) -> ObjectStoreL2Adapter:
    return ObjectStoreL2Adapter(store, owns_store=False, full_chunk_bytes=CHUNK,
                                naming=Naming(identity=IdentitySetting(identity)),
                                fleet=FleetConfig(node_id=name, **FLEET))  # fmt: skip


def chunk_names(store: MemoryStore, token: str) -> set[str]:
    return {i.name for i in store.list("") if f"~{token}@" in i.name}


def test_an_identity_no_live_node_uses_ages_out_under_max_age() -> None:
    shared = MemoryStore("generations")
    old_tok = IdentitySetting("org/model@rev-1").token(key(0).model_name)
    old = node(shared, "old", "org/model@rev-1")
    assert old.wait_until_rebuilt(10)
    old_keys, new_keys = [key(i) for i in range(8)], [key(i) for i in range(100, 102)]
    assert t.store(old, old_keys, [chunk(i, CHUNK) for i in range(8)]).success
    old.close()  # the old deployment is gone: no live node uses its identity
    assert len(chunk_names(shared, old_tok)) == 8
    new = node(shared, "new", "org/model@rev-2")
    try:
        assert new.wait_until_rebuilt(10)
        assert t.store(new, new_keys, [chunk(i, CHUNK) for i in range(100, 102)]).success
        assert t.lookup(new, old_keys) == [False] * 8  # the same keys: another identity's chunks
        assert new.get_usage().bytes_used == 2 * CHUNK  # its own index holds its own identity only
        # max_age_secs is a TTL from the store (docs/fleet.md): the live node removes the chunks of
        # the identity nobody runs any more (as it would its own, unless used within grace_secs)
        assert until(lambda: not chunk_names(shared, old_tok), 30), "the old identity's chunks stayed"
        assert new.report_status()["fleet"]["evicted_cross_node"] >= 8
    finally:
        new.close()
