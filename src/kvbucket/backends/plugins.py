"""Where remote tiers come from: ``remote_url`` schemes and ``remote_storage_plugins`` types.

Both registries map a name to a factory given as ``"module:function"`` (imported only when used,
so kvbucket does not import every client library) or as a callable.

- ``remote_url`` by scheme, factory ``(url, extra_config, engine) -> ObjectStore``, where
  ``extra_config`` holds the engine's ``extra_config`` minus the ``remote_storage_plugin.*`` keys.
- ``remote_storage_plugins`` by type (the part of ``type[.instance]`` before the first ``.``),
  factory ``(instance_name, options, engine) -> ObjectStore``, where ``options`` are the keys under
  ``remote_storage_plugin.<instance_name>.`` with that prefix stripped.

Factories validate the keys they get strictly and raise :class:`ConfigError` for unknown ones.
They never see a tier's fleet keys (``fleet``, ``max_capacity_gb``, ``eviction``,
:mod:`kvbucket.backends.fleet`) or read-ahead keys (``read_ahead``, ``read_ahead_max_gb``,
``read_ahead_ttl_secs``, :mod:`kvbucket.stores.guard.read_ahead`): :func:`remote_tier_specs` takes those
out first, for any store.

This module reads an :class:`~kvbucket.engine_config.EngineConfig` (the settings module below
the backends), never :mod:`kvbucket.config` (which hands out ``build_backend`` from above them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbucket.backends.fleet import parse_fleet_settings, split_fleet_keys
from kvbucket.did_you_mean import did_you_mean
from kvbucket.errors import ConfigError
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings, split_read_ahead_keys
from kvbucket.stores.local.memory import MemoryStore

if TYPE_CHECKING:
    from kvbucket.engine_config import EngineConfig
    from kvbucket.integrations.engine_fleet import FleetSettings

PLUGIN_KEY_PREFIX = "remote_storage_plugin."

Factory = str | Callable[..., ObjectStore]

URL_SCHEMES: dict[str, Factory] = {
    "file": "kvbucket.backends.plugins:file_store_from_remote_url",
    "memory": "kvbucket.backends.plugins:memory_store_from_remote_url",
    "s3": "kvbucket.stores.s3.store:store_from_remote_url",
    "hf": "kvbucket.stores.hub.open:store_from_remote_url",
}

PLUGIN_TYPES: dict[str, Factory] = {
    "hfbucket": "kvbucket.stores.hub.open:store_from_plugin_options",
}


def register_url_scheme(scheme: str, factory: Factory) -> None:
    URL_SCHEMES[scheme] = factory


def register_plugin_type(plugin_type: str, factory: Factory) -> None:
    PLUGIN_TYPES[plugin_type] = factory


def url_scheme(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else "file"


def _resolve(factory: Factory, what: str) -> Callable[..., ObjectStore]:
    if callable(factory):
        return factory
    module_name, _, attr = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} is not available in this installation ({module_name}: {e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{what} is not available: {module_name} has no {attr}")
    return fn


#: extra_config keys that configure kvbucket itself (every tier), not a store: see EngineConfig.
ENGINE_KEYS = frozenset({"encryption", "unsealed", "model_identity", "metrics"})


def plugin_type(instance: str) -> str:
    return instance.split(".", 1)[0]


def split_extra_config(engine: EngineConfig) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split ``extra_config`` into the remote_url store's keys and each plugin instance's options.

    Raises :class:`ConfigError` for plugin keys of instances not in ``remote_storage_plugins`` and
    for keys no configured component takes.
    """
    instances = list(engine.remote_storage_plugins)
    per_instance: dict[str, dict[str, Any]] = {name: {} for name in instances}
    url_options: dict[str, Any] = {}
    # longest instance name first, so "hfbucket.us.x" goes to "hfbucket.us" when both exist
    by_length = sorted(instances, key=len, reverse=True)
    for key, value in engine.extra_config.items():
        if key in ENGINE_KEYS:
            continue  # kvbucket's own engine-wide settings, taken by build_backend
        if not key.startswith(PLUGIN_KEY_PREFIX):
            url_options[key] = value
            continue
        rest = key[len(PLUGIN_KEY_PREFIX) :]
        owner = next((i for i in by_length if rest.startswith(i + ".") and len(rest) > len(i) + 1), None)
        if owner is None:
            guess = rest.rsplit(".", 1)[0] if "." in rest else rest
            listed = ", ".join(repr(i) for i in instances) or "none"
            raise ConfigError(
                f"extra_config key {key!r} configures remote storage plugin {guess!r}, which is not listed "
                f"in remote_storage_plugins (listed: {listed}); add {guess!r} to remote_storage_plugins or "
                "remove the key"
            )
        per_instance[owner][rest[len(owner) + 1 :]] = value
    if url_options and not engine.remote_url:
        raise ConfigError(
            f"extra_config key(s) {', '.join(sorted(url_options))} are not taken by any configured "
            "component: they configure the remote_url store, but remote_url is not set. Set remote_url, "
            f"put plugin options under {PLUGIN_KEY_PREFIX}<name>.<option>, or remove them"
        )
    return url_options, per_instance


@dataclass(frozen=True)
class RemoteTierSpec:
    """One remote tier an engine config names: its label (the URL or the plugin instance), its
    store's options (fleet keys removed) and its fleet settings (None: not in a fleet)."""

    label: str
    options: dict[str, Any]
    fleet: FleetSettings | None
    plugin: bool  # a remote_storage_plugins instance, else the remote_url store
    read_ahead: ReadAheadSettings = field(default_factory=ReadAheadSettings)  # its read_ahead* keys


def remote_tier_specs(engine: EngineConfig) -> list[RemoteTierSpec]:
    """The remote tiers in config order, every key checked before any store is opened (a bad
    fleet setting fails at once, naming its key, without a request)."""
    url_options, per_instance = split_extra_config(engine)
    specs: list[RemoteTierSpec] = []
    if engine.remote_url:
        options, fleet = split_fleet_keys(url_options)
        options, ahead = split_read_ahead_keys(options)
        fleet_settings = parse_fleet_settings(fleet, "")
        specs.append(RemoteTierSpec(engine.remote_url, options, fleet_settings, False, ahead))
    for instance in engine.remote_storage_plugins:
        options, fleet = split_fleet_keys(per_instance[instance])
        where = f"{PLUGIN_KEY_PREFIX}{instance}."
        options, ahead = split_read_ahead_keys(options, where)
        specs.append(RemoteTierSpec(instance, options, parse_fleet_settings(fleet, where), True, ahead))
    return specs


def open_remote_store(engine: EngineConfig, spec: RemoteTierSpec) -> ObjectStore:
    """The store of one tier, from its scheme's or plugin type's factory."""
    if not spec.plugin:
        scheme = url_scheme(spec.label)
        factory = URL_SCHEMES.get(scheme)
        if factory is None:
            known = ", ".join(f"{s}://" for s in URL_SCHEMES)
            raise ConfigError(
                f"remote_url scheme {scheme!r} is not supported; {did_you_mean(scheme, URL_SCHEMES)}"
                f"use one of {known} or a directory path"
            )
        fn = _resolve(factory, f"the {scheme}:// remote store")
        return _checked(fn(spec.label, dict(spec.options), engine), scheme)
    ptype = plugin_type(spec.label)
    factory = PLUGIN_TYPES.get(ptype)
    if factory is None:
        known = ", ".join(sorted(PLUGIN_TYPES))
        raise ConfigError(
            f"remote_storage_plugins entry {spec.label!r} has unknown type {ptype!r}; "
            f"{did_you_mean(ptype, PLUGIN_TYPES)}known types: {known}"
        )
    fn = _resolve(factory, f"the {ptype} remote storage plugin")
    return _checked(fn(spec.label, dict(spec.options), engine), spec.label)


def open_remote_stores(engine: EngineConfig) -> list[tuple[str, ObjectStore]]:
    """The remote stores an engine config names, as ``(label, store)`` in config order."""
    opened: list[tuple[str, ObjectStore]] = []
    try:
        for spec in remote_tier_specs(engine):
            opened.append((spec.label, open_remote_store(engine, spec)))
    except BaseException:
        for _, store in opened:
            store.close()
        raise
    return opened


def _checked(store: Any, what: str) -> ObjectStore:
    if not isinstance(store, ObjectStore):
        raise ConfigError(f"the factory for {what} returned {type(store).__name__}, not an ObjectStore")
    return store


# ---- built-in factories -----------------------------------------------------------------------


def file_store_from_remote_url(url: str, extra_config: dict[str, Any], engine: EngineConfig) -> ObjectStore:
    """``file:///dir`` or a bare path; extra_config may hold ``fsync`` (bool)."""
    from kvbucket.stores.local.open_file import open_file_store

    unknown = set(extra_config) - {"fsync"}
    if unknown:
        raise ConfigError(
            f"extra_config key(s) {', '.join(sorted(unknown))} are not options of the file:// remote store "
            "(it takes: fsync)"
        )
    return open_file_store(url, **extra_config)


def memory_store_from_remote_url(url: str, extra_config: dict[str, Any], engine: EngineConfig) -> ObjectStore:
    """``memory://name``: a process-local store, for tests and the demo."""
    if extra_config:
        raise ConfigError(
            f"extra_config key(s) {', '.join(sorted(extra_config))} are not options of the memory:// remote "
            "store (it takes none)"
        )
    return MemoryStore(url.partition("://")[2])


__all__ = [
    "PLUGIN_TYPES",
    "URL_SCHEMES",
    "RemoteTierSpec",
    "file_store_from_remote_url",
    "memory_store_from_remote_url",
    "open_remote_store",
    "open_remote_stores",
    "plugin_type",
    "register_plugin_type",
    "register_url_scheme",
    "remote_tier_specs",
    "split_extra_config",
    "url_scheme",
]
