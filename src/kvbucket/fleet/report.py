"""The fleet's picture of a prefix for operators (``kvbucket du``), read without joining it."""

from __future__ import annotations

from typing import Any

from kvbucket.fleet.config import FleetConfig
from kvbucket.stores.base import ObjectStore


def inspect_fleet(store: ObjectStore, prefix: str = "") -> dict[str, Any] | None:
    """The fleet's picture of a prefix, read-only (for ``kvbucket du``): None when no fleet
    ever wrote there. Costs the digest and snapshot GETs; without a fresh digest, one listing of
    ``_fleet/`` plus the snapshot and journal GETs."""
    from types import SimpleNamespace

    from kvbucket.backends.salt import chunk_salt as backend_salt
    from kvbucket.integrations.naming import chunk_salt

    def engine_chunk(name: str) -> Any:  # engine tiers' and storage backends' names (L2 keys parse anyway)
        salt = chunk_salt(name)
        if salt is None:
            salt = backend_salt(name, prefix)
        return None if salt is None else SimpleNamespace(cache_salt=salt)

    from kvbucket.fleet.sync import Fleet

    reader = Fleet(store, FleetConfig(node_id="kvbucket-inspect"), prefix=prefix, parse=engine_chunk)
    if not reader.read_only():
        return None
    status = reader.status()
    status["nodes"].pop(reader.node, None)
    status["live_nodes"] = [n for n in status["live_nodes"] if n != reader.node]
    internal = ("node", "ready", "evicted_own", "evicted_cross_node", "compactor", "sync_interval_secs",
                "coordination_credit", "data_requests")
    for field_name in internal:
        status.pop(field_name, None)
    return status


__all__ = ["inspect_fleet"]
