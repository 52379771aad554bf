"""The remote tiers' fleet settings: one capacity for every engine whose backends share a prefix.

A ``RemoteBackend`` keeps no index of its own (lookups are HEADs with a small TTL cache), so it
takes part in a fleet like LMCache's non-MP connector and the engine tiers do, through
:class:`kvbucket.fleet.member.StoreFleet`: it asks the fleet before a store (a refused chunk is a
failed put, :class:`FleetWriteCapError`), tells it what it stored, loaded and removed, deletes
its share of the fleet-wide victims after each round, and forgets chunks the fleet deleted.

The keys are the connector's (``fleet``, ``max_capacity_gb``, ``eviction``), so one engine YAML
configures both paths: ``remote_storage_plugin.<instance>.<key>`` for a plugin instance and
plain ``extra_config.<key>`` for the ``remote_url`` store (whose options are plain keys too).

The fleet's salt of a chunk (its per-salt fair share, ``pinned_salts``) is its key's
``cache_salt`` request tag (:mod:`kvbucket.backends.salt`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvbucket.backends.salt import SALT_CONFIG, chunk_salt
from kvbucket.errors import ConfigError, StoreError

if TYPE_CHECKING:
    from kvbucket.fleet.member import StoreFleet
    from kvbucket.integrations.engine_fleet import FleetSettings
    from kvbucket.stores.base import ObjectStore

#: The keys a remote tier's fleet takes, named as on LMCache's non-MP connector.
FLEET_KEYS = ("fleet", "max_capacity_gb", "eviction")


class FleetWriteCapError(StoreError):
    """The shared prefix is at its fleet write cap: the chunk was not stored (nor counted)."""


REFUSED = ("not stored: the shared prefix is at its fleet write cap (max_capacity_gb * fleet.write_cap); "
           "eviction makes room within a few sync rounds")


def split_fleet_keys(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (the store's own options, the fleet keys)."""
    store = {k: v for k, v in options.items() if k not in FLEET_KEYS}
    fleet = {k: v for k, v in options.items() if k in FLEET_KEYS}
    return store, fleet


def parse_fleet_settings(keys: Mapping[str, Any], where: str) -> FleetSettings | None:
    """The fleet keys of one remote tier, validated (None: no fleet keys). ``where`` is how the
    keys are spelled in the engine config (``remote_storage_plugin.hfbucket.`` or ``""``), so
    every error names the key as the user wrote it, and the fix."""
    from kvbucket.integrations.engine_fleet import FleetSettings

    if not keys:
        return None
    given = [f"extra_config.{where}{k}" for k in ("max_capacity_gb", "eviction") if keys.get(k)]
    if keys.get("fleet") is None and given:
        raise ConfigError(
            f"{' and '.join(given)} need extra_config.{where}fleet: a remote tier keeps no index of its "
            f"own, so only the fleet can count the shared prefix. Add {where}fleet: {{}} (the defaults) or "
            "a fleet object, e.g. {sync_secs: 5, grace_secs: 10}, or remove the capacity"
        )
    for name in ("fleet", "eviction"):
        if keys.get(name) is not None and not isinstance(keys[name], Mapping):
            raise ConfigError(
                f"extra_config.{where}{name} must be a mapping of settings (e.g. {{}} for the defaults), "
                f"got {type(keys[name]).__name__}"
            )
    try:
        return FleetSettings.model_validate(dict(keys))
    except ValidationError as e:
        lines = []
        for err in e.errors(include_input=False, include_url=False):
            key = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":  # the settings it takes, named (a wheel has no docs/)
                known = _settings_at(err["loc"][:-1], FleetSettings)
                msg = "unknown setting; it takes " + ", ".join(known) if known else "unknown setting"
            lines.append(f"extra_config key {where + key!r}: {msg}")
        raise ConfigError("invalid remote-tier fleet settings:\n  " + "\n  ".join(lines)) from None


def open_tier_fleet(settings: FleetSettings, raw: ObjectStore, chunks: ObjectStore, prefix: str,
                    on_gone: Callable[[list[str]], None]) -> StoreFleet | None:
    """The tier's fleet membership (None without ``fleet``). ``raw`` holds the fleet's objects,
    ``chunks`` is the sealed view the tier stores through; ``on_gone`` hears of deleted chunks."""
    if settings.fleet is None:
        return None
    from kvbucket.fleet.member import StoreFleet
    from kvbucket.l2.config import GIB
    from kvbucket.l2.eviction import EvictionConfig

    return StoreFleet(raw, chunks, settings.fleet, capacity=int(settings.max_capacity_gb * GIB),
                      eviction=settings.eviction or EvictionConfig(),
                      parse_salt=lambda name: chunk_salt(name, prefix), on_gone=on_gone)


__all__ = [
    "FLEET_KEYS",
    "REFUSED",
    "SALT_CONFIG",
    "FleetWriteCapError",
    "chunk_salt",
    "open_tier_fleet",
    "parse_fleet_settings",
    "split_fleet_keys",
]


def _settings_at(loc: tuple[Any, ...], model: Any) -> list[str]:
    """The setting names a pydantic model takes at ``loc`` (a path of field names into nested
    models, ``X | None`` unwrapped); [] when ``loc`` leads to no model."""
    import typing

    from pydantic import BaseModel

    for part in loc:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return []
        kinds = [a for a in (typing.get_args(field.annotation) or (field.annotation,))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not kinds:
            return []
        model = kinds[0]
    return sorted(getattr(model, "model_fields", {}))
