"""MP mode: :class:`KVBucketL2Adapter`, LMCache's ``L2AdapterInterface`` (``lmcache server`` /
``lmcache bench l2``) over :class:`kvbucket.l2.ObjectStoreL2Adapter`, loaded by LMCache from
``kvbucket.integrations.lmcache`` (see that package's docstring for the spec)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage
from lmcache.v1.distributed.api import ObjectKey as LMObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId

from kvbucket.integrations.lmcache.keys import to_kvbucket_key, to_lmcache_key
from kvbucket.keys import ObjectKey
from kvbucket.l2.adapter import ObjectStoreL2Adapter
from kvbucket.l2.config import L2CommonConfig
from kvbucket.l2.registry import open_l2_adapter, parse_l2_config
from kvbucket.metrics_server import serve_metrics

log = logging.getLogger("kvbucket.integrations.lmcache")


def _bitmap(bits: Sequence[bool]) -> Bitmap:
    bm = Bitmap(len(bits))
    if all(bits):
        bm.set_range(0, len(bits))
    else:
        bm.batched_set([i for i, b in enumerate(bits) if b])
    return bm


def _layout_bytes(group_layout_descs: Any) -> dict[int, int] | None:
    """Full chunk bytes per object group from LMCache's ``MemoryLayoutDesc`` hints."""
    if not isinstance(group_layout_descs, dict):
        return None
    out: dict[int, int] = {}
    for group, desc in group_layout_descs.items():
        shapes = getattr(desc, "shapes", None) or []
        dtypes = getattr(desc, "dtypes", None) or []
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=False))
        if total > 0:
            out[int(group)] = int(total)
    return out or None


def _log_as_lmcache() -> None:
    """Under LMCache (``lmcache server``) kvbucket's log lines go where LMCache's go, at its level
    (``LMCACHE_LOG_LEVEL``, INFO by default). LMCache's ``init_logger`` sets up only its own
    loggers, so kvbucket's reached Python's last-resort handler, which drops INFO: the default
    eviction line docs/l2.md promises was never shown. A process that configured logging itself
    (a root handler, or one on ``kvbucket``) is left alone."""
    if logging.getLogger("kvbucket").handlers or logging.getLogger().handlers:
        return
    from lmcache.logging import init_logger

    init_logger("kvbucket")


class _Listener:
    def __init__(self, owner: KVBucketL2Adapter) -> None:
        self._owner = owner

    def on_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self._owner._notify_keys_stored([to_lmcache_key(k) for k in keys], sizes)

    def on_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self._owner._notify_keys_accessed([to_lmcache_key(k) for k in keys])

    def on_keys_deleted(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self._owner._notify_keys_deleted([to_lmcache_key(k) for k in keys], sizes)


class KVBucketL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over :class:`kvbucket.l2.ObjectStoreL2Adapter`."""

    def __init__(
        self, config: dict[str, Any] | str | L2CommonConfig, l1_memory_desc: Any = None, **_: Any
    ) -> None:
        _log_as_lmcache()
        cfg = parse_l2_config(config)  # ConfigError is a ValueError: LMCache reports it as a bad spec
        super().__init__(max_capacity_bytes=cfg.max_capacity_bytes)
        self.config = cfg
        # metrics_port: a metrics-only endpoint (`lmcache server` also serves the registry on its
        # HTTP API's /metrics, next to its admin routes); once per process, before the store
        # opens, so a taken port fails with nothing to undo.
        self.metrics = None if cfg.metrics_port is None else serve_metrics(cfg.metrics_port, cfg.metrics_addr)
        self._impl = open_l2_adapter(cfg, listener=_Listener(self))
        log.info("kvbucket L2 adapter on %s (%s workers)", self._impl.store.url, cfg.num_workers)

    @property
    def impl(self) -> ObjectStoreL2Adapter:
        return self._impl

    def get_store_event_fd(self) -> int:
        return self._impl.get_store_event_fd()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._impl.get_lookup_and_lock_event_fd()

    def get_load_event_fd(self) -> int:
        return self._impl.get_load_event_fd()

    def submit_store_task(self, keys: list[LMObjectKey], objects: list[Any]) -> L2TaskId:
        return self._impl.submit_store_task(
            [to_kvbucket_key(k) for k in keys], [o.byte_array for o in objects], keepalive=objects
        )

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return {
            tid: L2StoreResult(r.success, r.bytes_stored)
            for tid, r in self._impl.pop_completed_store_tasks().items()
        }

    def submit_lookup_and_lock_task(
        self, keys: list[LMObjectKey], group_layout_descs: Any = None
    ) -> L2TaskId:
        return self._impl.submit_lookup_and_lock_task(
            [to_kvbucket_key(k) for k in keys], _layout_bytes(group_layout_descs)
        )

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        bits = self._impl.query_lookup_and_lock_result(task_id)
        return None if bits is None else _bitmap(bits)

    def submit_unlock(self, keys: list[LMObjectKey]) -> None:
        self._impl.submit_unlock([to_kvbucket_key(k) for k in keys])

    def submit_load_task(self, keys: list[LMObjectKey], objects: list[Any]) -> L2TaskId:
        return self._impl.submit_load_task(
            [to_kvbucket_key(k) for k in keys], [o.byte_array for o in objects], keepalive=objects
        )

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        bits = self._impl.query_load_result(task_id)
        return None if bits is None else _bitmap(bits)

    def delete(self, keys: list[LMObjectKey]) -> None:
        self._impl.delete([to_kvbucket_key(k) for k in keys])

    def get_usage(self) -> AdapterUsage:
        u = self._impl.get_usage()
        return AdapterUsage(u.bytes_used, u.capacity_bytes, MappingProxyType(dict(u.bytes_by_cache_salt)))

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        page = self._impl.list_keys(model_name, page_size, cursor)
        entries = tuple(
            KeyEntry(key=to_lmcache_key(k).to_encoded_object_key(), size_bytes=s) for k, s in page.entries
        )
        return KeyListPage(entries=entries, next_page_token=page.next_cursor)

    def report_status(self) -> dict:
        return self._impl.report_status()

    def close(self) -> None:
        self._impl.close()

