"""``build_backend``: the backend stack an engine config describes (local_cpu -> local_disk ->
remote(s)).

It lives here, next to the tiers it builds, and reads the settings from
:mod:`kvbucket.engine_config` (below the backends). ``from kvbucket.config import build_backend``
still works: :mod:`kvbucket.config`, the module users import from, hands this function out on
first use, so the imports run one way (config -> backends.build -> engine_config).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.plugins import open_remote_store, remote_tier_specs
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.encryption import Keyring
from kvbucket.errors import ConfigError
from kvbucket.metrics import InstrumentedBackend, InstrumentedStore

if TYPE_CHECKING:
    from kvbucket.chunks import KVLayout
    from kvbucket.engine_config import EngineConfig


def build_backend(config: EngineConfig, layout: KVLayout) -> StorageBackend:
    """The backend stack a config describes: local_cpu -> local_disk -> remote(s).

    One tier is returned as itself; several become a :class:`HybridBackend` (write-through,
    read-through with promotion). ``enable_async_loading`` selects the pipelined remote backend.
    A remote tier with fleet keys (``fleet``, ``max_capacity_gb``, ``eviction``) joins its
    prefix's fleet (docs/fleet.md); every key is checked before anything is opened.

    Metrics are on unless ``extra_config.metrics`` is false: each tier comes wrapped in an
    :class:`~kvbucket.metrics.InstrumentedBackend` (``.inner`` is the tier) labelled
    ``local_cpu``, ``local_disk``, ``remote`` (the ``remote_url`` tier) or ``remote:<instance>``
    (a plugin instance), and each remote store is counted under its URL, the label its circuit
    breaker, read-ahead and fleet series carry too; so ``start_metrics_server`` and
    ``kvbucket stats`` show them without wrapping anything by hand.
    """
    if layout.chunk_tokens != config.chunk_size:
        raise ConfigError(
            f"the KV layout has {layout.chunk_tokens} tokens per chunk but chunk_size is "
            f"{config.chunk_size}; "
            f"build the layout with chunk_tokens={config.chunk_size} (layout.with_chunk_tokens(...)) or fix "
            "chunk_size"
        )
    remotes = remote_tier_specs(config)
    tiers: list[StorageBackend] = []
    keyring = Keyring.from_setting(config.encryption)  # one keyring (and one error) for every tier

    def counted(tier: StorageBackend, name: str) -> StorageBackend:
        return InstrumentedBackend(tier, name) if config.metrics else tier

    try:
        if config.local_cpu:
            tiers.append(counted(LocalCPUBackend(config.local_cpu_bytes), "local_cpu"))
        if config.local_disk is not None:
            disk = LocalDiskBackend(config.local_disk, config.local_disk_bytes, encryption=keyring,
                                    model_identity=config.model_identity)
            tiers.append(counted(disk, "local_disk"))
        remote_cls = PipelinedRemoteBackend if config.enable_async_loading else RemoteBackend
        for spec in remotes:
            store = open_remote_store(config, spec)
            if config.metrics:  # the store that makes the requests, under sealing and read-ahead
                store = InstrumentedStore(store, name=store.url)
            try:
                tiers.append(counted(remote_cls(
                    store,
                    layout,
                    serde=config.remote_serde,
                    save_unfull_chunk=config.save_unfull_chunk,
                    blocking_timeout_secs=config.blocking_timeout_secs,
                    unsealed=config.unsealed,
                    encryption=keyring,
                    fleet=spec.fleet,
                    read_ahead=spec.read_ahead if config.metrics else replace(spec.read_ahead, metrics=False),
                    model_identity=config.model_identity,
                ), f"remote:{spec.label}" if spec.plugin else "remote"))
            except BaseException:
                store.close()
                raise
    except BaseException:
        for t in tiers:
            t.close()
        raise
    if not tiers:
        raise ConfigError(
            "the config stores nothing: set local_cpu: true, local_disk (+ max_local_disk_size), remote_url "
            "or remote_storage_plugins"
        )
    return tiers[0] if len(tiers) == 1 else HybridBackend(tiers)


__all__ = ["build_backend"]
