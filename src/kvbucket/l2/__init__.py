"""MP-mode L2 adapters: submit-and-poll persistence of KV chunks over any object store.

``open_l2_adapter(spec)`` builds an adapter from a ``--l2-adapter`` JSON spec (types ``fs``,
``hfbucket``, ``s3``); :class:`ObjectStoreL2Adapter` wraps any
:class:`~kvbucket.stores.base.ObjectStore` directly. LMCache loads them through
:mod:`kvbucket.integrations.lmcache`.
"""

from __future__ import annotations

from kvbucket.l2.adapter import L2Listener, ObjectStoreL2Adapter
from kvbucket.l2.base import EventNotifier, KeyPage, L2Adapter, L2TaskId, StoreResult, Usage
from kvbucket.l2.config import FsL2Config, HFBucketL2Config, L2CommonConfig, S3L2Config
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.l2.registry import l2_types, open_l2_adapter, parse_l2_config, register_l2_type

__all__ = [
    "EventNotifier",
    "EvictionConfig",
    "FsL2Config",
    "HFBucketL2Config",
    "KeyPage",
    "L2Adapter",
    "L2CommonConfig",
    "L2Listener",
    "L2TaskId",
    "ObjectStoreL2Adapter",
    "S3L2Config",
    "StoreResult",
    "Usage",
    "l2_types",
    "open_l2_adapter",
    "parse_l2_config",
    "register_l2_type",
]
