"""Adapter types by name: ``type`` -> (config model, function building the object store).

``open_l2_adapter('{"type": "fs", "base_path": "/tmp/kv"}')`` parses the spec strictly,
builds the store and wraps it in the one adapter implementation. Store modules are imported
only when their type is used, so ``kvbucket.l2`` imports no cloud client by itself.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvbucket.did_you_mean import did_you_mean
from kvbucket.errors import ConfigError
from kvbucket.identity.core import IdentitySetting
from kvbucket.l2.adapter import L2Listener, ObjectStoreL2Adapter
from kvbucket.l2.config import (
    FsL2Config,
    HFBucketL2Config,
    L2CommonConfig,
    S3L2Config,
    format_validation_error,
    load_spec,
)
from kvbucket.l2.naming import Naming
from kvbucket.metrics import InstrumentedStore
from kvbucket.metrics_server import serve_metrics
from kvbucket.stores.base import ObjectStore

StoreBuilder = Callable[[Any], ObjectStore]

_TYPES: dict[str, tuple[type[L2CommonConfig], StoreBuilder]] = {}


def register_l2_type(name: str, config_cls: type[L2CommonConfig], build_store: StoreBuilder) -> None:
    """Add an adapter type (e.g. a new object store) under ``name``."""
    if name in _TYPES and _TYPES[name][0] is not config_cls:
        raise ValueError(f"L2 adapter type {name!r} is already registered")
    _TYPES[name] = (config_cls, build_store)


def l2_types() -> list[str]:
    return sorted(_TYPES)


def parse_l2_config(spec: str | dict[str, Any] | L2CommonConfig) -> L2CommonConfig:
    """Validate a spec (JSON string, dict or config) into its type's config model."""
    if isinstance(spec, L2CommonConfig):
        return spec
    d = load_spec(spec)
    type_name = d.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f'the L2 adapter spec needs a "type" field, one of: {", ".join(l2_types())}')
    entry = _TYPES.get(type_name)
    if entry is None:
        raise ConfigError(f"unknown L2 adapter type {type_name!r}; {did_you_mean(type_name, l2_types())}"
                          f"known types: {', '.join(l2_types())}")
    try:
        return entry[0].model_validate(d)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, f"L2 adapter {type_name!r}", entry[0])) from None


def build_store(config: L2CommonConfig) -> ObjectStore:
    type_name = getattr(config, "type", None)
    if type_name not in _TYPES:
        raise ConfigError(f"no store builder for L2 adapter type {type_name!r}")
    return _TYPES[type_name][1](config)


def instrumented(store: ObjectStore) -> InstrumentedStore:
    """``store`` counted in kvbucket's per-store metrics, labelled with its URL (as its circuit
    breaker and fleet series are; a URL never holds credentials). The adapter and the connector
    wrap the store that makes the requests, under the sealing layer and the read-ahead buffer,
    so the bytes and latency counted are those of real requests."""
    return InstrumentedStore(store, name=store.url)


def store_options(config: L2CommonConfig) -> dict[str, bool]:
    """How the adapter should drive this type's store: the S3 and bucket stores run a batch's
    items concurrently themselves (and a bucket batch is one commit), so they get whole batches."""
    return {"split_batches": getattr(config, "type", None) not in ("hfbucket", "s3")}


def open_l2_adapter(
    spec: str | dict[str, Any] | L2CommonConfig, *, listener: L2Listener | None = None
) -> ObjectStoreL2Adapter:
    """Parse ``spec``, open its store and return a running adapter (close it when done).

    ``metrics_port`` serves kvbucket's metrics here as in LMCache's plugin (once per port and
    process, :func:`~kvbucket.metrics_server.serve_metrics`), before the store opens: a taken
    port fails with nothing to undo."""
    config = parse_l2_config(spec)
    if config.metrics_port is not None:
        serve_metrics(config.metrics_port, config.metrics_addr)
    naming = naming_for(config)
    store = instrumented(build_store(config))
    work_dir = None
    try:
        work_dir = make_work_dir(config, "hfbucket-mp-")
        return ObjectStoreL2Adapter(
            store,
            num_workers=config.num_workers,
            max_capacity_bytes=config.max_capacity_bytes,
            eviction=config.eviction,
            metadata_cache_ttl_secs=config.metadata_cache_ttl_secs,
            full_chunk_bytes=config.full_chunk_bytes,
            listener=listener,
            naming=naming,
            work_dir=work_dir,
            fleet=config.fleet,
            unsealed=config.unsealed,
            encryption=config.encryption,
            read_ahead=config.read_ahead_settings(),
            **store_options(config),
        )
    except Exception:
        store.close()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
        raise


def naming_for(config: L2CommonConfig, *, connector: bool = False) -> Naming:
    """The names an adapter (or the non-MP connector) of this config writes and reads: kvbucket's
    and those of LMCache's built-in for the same type (names relative to the store's prefix)."""
    try:
        style = getattr(config, "type", None)
        return Naming(style=style, object_format=config.object_format, connector=connector,
                      identity=IdentitySetting(config.model_identity),
                      accept_name_only=config.accept_name_only)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_work_dir(config: L2CommonConfig, prefix: str) -> Path | None:
    """LMCache's download session dir: ``download_tmp_dir`` is created (with parents) and a
    fresh ``<prefix>XXXX`` directory made in it, which the adapter removes on close."""
    root = getattr(config, "download_tmp_dir", None)
    if not root:
        return None
    base = Path(root).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


# ---- built-in types --------------------------------------------------------------------------
def _fs_store(config: FsL2Config) -> ObjectStore:
    from kvbucket.stores.local.file import FileStore

    return FileStore(config.base_path, fsync=config.fsync)


def _hfbucket_store(config: HFBucketL2Config) -> ObjectStore:
    from kvbucket.stores.hub.store import HFBucketStore  # type: ignore[import-not-found]

    return HFBucketStore.from_config(config)


def _s3_store(config: S3L2Config) -> ObjectStore:
    from kvbucket.stores.s3.store import S3Store  # type: ignore[import-not-found]

    return S3Store.from_config(config)


register_l2_type("fs", FsL2Config, _fs_store)
register_l2_type("hfbucket", HFBucketL2Config, _hfbucket_store)
register_l2_type("s3", S3L2Config, _s3_store)

__all__ = [
    "build_store",
    "instrumented",
    "l2_types",
    "make_work_dir",
    "naming_for",
    "open_l2_adapter",
    "parse_l2_config",
    "register_l2_type",
    "store_options",
]
