"""kvbucket as SGLang's HiCache L3 storage: one bucket (or S3 prefix, or directory) shared by workers.

SGLang (0.5.23) loads it with its own ``StorageBackendFactory`` and the ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvbucket", "module_path": "kvbucket.integrations.sglang",
        "class_name": "KVBucketHiCacheStorage", "interface_v1": 1,
        "store_url": "hf://buckets/my-org/kv-cache"}'

Pages are stored as sealed objects (:mod:`kvbucket.stores.guard.sealed`: a failed check is a miss) named

    ``<prefix>/<model>/<salt>/<shard>/<layout>/<page hash>``

- ``model``: SGLang's ``model_name`` (``/`` -> ``--``) and ``~<token>``, the model's identity
  (:mod:`kvbucket.integrations.engine_identity`: SGLang's ModelConfig, else the model's files).
- ``salt``: ``cache_salt`` of the extra config (a deployment-wide namespace, hashed: never stored
  in clear). Per-request ``cache_salt``/``extra_key`` need nothing here: SGLang seeds the page
  hash chain with them (``storage_namespace_seed``), so their pages already have other hashes.
- ``shard``: who wrote the bytes. MLA KV is the same on every TP rank, so all ranks share one
  shard (written by SGLang's storage writer rank only, ``is_storage_writer``); other models get
  one shard per TP rank (``tp<rank>of<size>``). Pipeline, attention-CP and DCP ranks are added as
  in SGLang's file backend.
- ``layout``: the host pool's layout, dtype, page size and bytes per page, so a page written by a
  pool with another byte order is never read into this one.

This module imports without SGLang (kvbucket does not depend on it); creating the backend needs
it. Read from ``storage_config.extra_config``: ``store_url`` (required), ``store_options``
(keyword options of :func:`kvbucket.stores.open_store`), ``cache_salt``, ``prefix``
(default ``sglang``), ``unsealed``, ``encryption`` (as for the other tiers), and the fleet keys
``fleet``, ``max_capacity_gb``, ``eviction`` (:mod:`kvbucket.integrations.engine_fleet`: workers
on one store share one capacity; a page the fleet refuses is a failed set).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from kvbucket.errors import ConfigError
from kvbucket.identity.core import qualify
from kvbucket.identity.manifest import Manifest
from kvbucket.integrations.engine_fleet import REFUSED, open_fleet
from kvbucket.integrations.engine_identity import resolve
from kvbucket.integrations.engine_settings import EngineTierSettings
from kvbucket.integrations.naming import path_segment as _segment
from kvbucket.integrations.naming import salt_segment as _salt_segment
from kvbucket.integrations.tensor_regions import StorageViews
from kvbucket.log_once import RepeatedLog
from kvbucket.stores.base import Gather, Scatter
from kvbucket.stores.guard.read_ahead import PrefetchStore, read_ahead, with_read_ahead

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)

try:  # SGLang is optional: the class below subclasses its interface when it is installed.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

    HAVE_SGLANG = True
except ImportError:  # pragma: no cover - depends on the venv
    HAVE_SGLANG = False
    HiCacheStorageConfig = Any  # type: ignore[misc,assignment]
    HiCacheStorageExtraInfo = Any  # type: ignore[misc,assignment]

    class _Base:  # type: ignore[no-redef]
        """Stands in for ``HiCacheStorage`` when SGLang is not installed (creating one says so)."""


# Keys SGLang itself reads from the same extra config (not ours, accepted and ignored).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}


class SGLangStorageSettings(EngineTierSettings):
    """kvbucket's part of ``--hicache-storage-backend-extra-config`` (with the store, fleet and
    read-ahead keys of every engine tier)."""

    cache_salt: str = Field("", description="deployment-wide namespace: other salts never see these pages")
    prefix: str = Field("sglang", description="first path segment of every page object")
    known_pages: int = Field(65536, ge=0, description="page names remembered as stored (skips rewrites)")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> SGLangStorageSettings:
        extra = dict(extra or {})
        ours = {k: v for k, v in extra.items() if k not in _SGLANG_KEYS and k not in _SGLANG_PASSTHROUGH}
        return cls.validated(
            ours, invalid="invalid kvbucket HiCache settings",
            no_store_url="the kvbucket HiCache backend needs \"store_url\" in "
            "--hicache-storage-backend-extra-config, e.g. {\"store_url\": \"hf://buckets/my-org/kv-cache\"}")


# SGLang's own tuning keys of the extra config that other backends read (not ours either).
_SGLANG_PASSTHROUGH = {"prefetch_threshold", "enable_metadata_cache", "metadata_ttl", "tp_lcm_size"}


def _sglang_model_config() -> Any:
    """The ModelConfig SGLang built for this process (memoized on its published server args), or
    None (not published: a backend built outside a server, as in tests). Never builds one."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return getattr(get_server_args(), "_model_config", None)
    except Exception:
        return None


def salt_segment(cache_salt: str) -> str:
    """The salt part of a page name: a digest, so a secret salt never appears in the bucket."""
    return _salt_segment(cache_salt, "sglang")


def shard_segment(cfg: Any) -> str:
    """Who owns the bytes of a page, following SGLang's file backend (see the module docstring)."""
    shard = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}"
    if cfg.pp_size > 1:
        shard += f"-pp{cfg.pp_rank}of{cfg.pp_size}"
    if getattr(cfg, "attn_cp_size", 1) > 1:
        shard += f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        shard += f"-tp{cfg.tp_size}-dcp{cfg.dcp_rank}of{cfg.dcp_size}-lp{cfg.logical_page_size}"
    return shard


def layout_segment(pool: Any) -> str:
    """The host pool's page byte format: layout, dtype, tokens and bytes per page."""
    page = pool.get_dummy_flat_data_page()
    nbytes = page.numel() * page.element_size()
    dtype = str(pool.dtype).removeprefix("torch.")
    tag = getattr(pool, "storage_format_tag", None)
    seg = f"{pool.layout}-{dtype}-p{pool.page_size}-b{nbytes}"
    return _segment(f"{seg}-{tag}" if tag else seg)


#: The setting the name-only warning names.
IDENTITY_SETTING = "model_identity in --hicache-storage-backend-extra-config"


class KVBucketHiCacheStorage(_Base):
    """SGLang ``HiCacheStorage`` over any kvbucket store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None,
                 *, store: Any = None) -> None:
        if not HAVE_SGLANG:
            raise ConfigError("kvbucket.integrations.sglang needs SGLang: pip install sglang")
        from kvbucket.metrics import InstrumentedStore
        from kvbucket.stores import open_store
        from kvbucket.stores.guard.sealed import seal_store

        self.settings = SGLangStorageSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.is_writer = bool(storage_config.is_storage_writer)
        opts = self.settings.store_options
        raw = store if store is not None else open_store(self.settings.store_url, **opts)
        self._raw = raw
        # batch_exists hits start their loads (read-ahead: kvbucket.stores.guard.read_ahead), behind the
        # check.
        # The store's series (requests, read-ahead) carry its URL, as its circuit breaker's do.
        self.store = with_read_ahead(
            seal_store(InstrumentedStore(raw, name=raw.url), tier="sglang", unsealed=self.settings.unsealed,
                       encryption=self.settings.encryption),
            self.settings.read_ahead_settings(), label=raw.url)
        model_name = storage_config.model_name or "model"
        # What SGLang resolved (its ModelConfig, memoized on the published server args) or the
        # model's files (kvbucket.integrations.engine_identity): the model's identity in every name.
        self.identity = resolve("kvbucket HiCache storage", model_name, self.settings, {},
                                _sglang_model_config(), key=IDENTITY_SETTING)
        model = qualify(_segment(model_name), self.identity.token if self.identity else None)
        self._base = "/".join((_segment(self.settings.prefix), model, salt_segment(self.settings.cache_salt),
                               shard_segment(storage_config)))
        self.manifest = None if self.identity is None else Manifest(
            raw, _segment(self.settings.prefix), self.identity, "kvbucket HiCache storage",
            model_key=_segment(model_name))
        if self.manifest is not None:
            self.manifest.start()
        self.prefix = f"{self._base}/unregistered"
        self.mem_pool_host: Any = None
        self.page_size = 1
        self._page_bytes: int | None = None  # a page's bytes, once the host pool is registered
        self._known: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._stage_lock = threading.Lock()
        self._staging: Any = None
        self._get_staging: Any = None
        self._views = StorageViews()
        # Pages move between the host pool and the store as the pool's own regions (writev /
        # readv, no staging copy); encryption needs one contiguous buffer, so it stages.
        self._in_place = self.store.keyring is None
        self._stats = {"get_pages": [], "set_pages": [], "get_bw": [], "set_bw": []}
        # Fleet members forget pages deleted anywhere in the fleet (else a page evicted elsewhere
        # would be "known" here: a lookup hit, then a miss at load, and never written again).
        self._fleet = open_fleet(self.settings, raw, self.store, self._forget)
        log.info("kvbucket HiCache storage on %s (%s)", self.store.url, self._base)

    # -- naming
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host KV pool (v1 transfers read/write its pages); its format joins the names."""
        self.mem_pool_host = mem_pool_host
        self.page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        self.prefix = f"{self._base}/{layout_segment(mem_pool_host)}"
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_bytes = page.numel() * page.element_size()

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _remember(self, names: Sequence[str]) -> None:
        if not self.settings.known_pages:
            return
        with self._lock:
            for n in names:
                self._known[n] = None
                self._known.move_to_end(n)
            while len(self._known) > self.settings.known_pages:
                self._known.popitem(last=False)

    def _forget(self, names: Sequence[str]) -> None:
        with self._lock:
            for n in names:
                self._known.pop(n, None)
        if isinstance(self.store, PrefetchStore):  # deleted in the fleet or gone: no read-ahead of it
            self.store.forget(names)

    # -- tensors <-> bytes
    def _stage(self, pages: list[tuple[str, Any]]) -> list[tuple[str, memoryview]]:
        """Pack the pages' bytes into the reused staging buffer (for pages that cannot be written
        from their regions: not on the CPU, or too many regions)."""
        import torch

        sizes = [t.numel() * t.element_size() for _, t in pages]
        total = sum(sizes)
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8)
        out, off = [], 0
        for (name, t), size in zip(pages, sizes, strict=True):
            region = self._staging[off : off + size]
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            region.view(src.dtype).view(src.shape).copy_(src)
            out.append((name, memoryview(region.numpy())))
            off += size
        return out

    def _page_tensor(self, index: int) -> Any:
        return self.mem_pool_host.get_data_page(index, flat=False)

    # -- existence
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Longest prefix of ``keys`` stored: one batched lookup (HEADs) for the names not known.
        The prefix's pages start loading now (read-ahead), for the ``batch_get_v1`` that follows."""
        names = [self._name(k) for k in keys]
        with self._lock:
            unknown = [i for i, n in enumerate(names) if n not in self._known]
        found = [True] * len(names)
        sizes: list[int | None] = [self._page_bytes] * len(names)
        if unknown:
            results = self.store.head_many([names[i] for i in unknown])
            for i, r in zip(unknown, results, strict=True):
                found[i] = r.error is None and r.size is not None
                sizes[i] = r.size
            self._remember([names[i] for i, r in zip(unknown, results, strict=True) if found[i]])
        hits = found.index(False) if False in found else len(found)
        read_ahead(self.store, names[:hits], sizes[:hits])
        return hits

    # -- zero-copy v1 (SGLang calls these with "interface_v1": 1)
    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices`` (``page_size`` token slots per key) under ``keys``."""
        if not self._check_indices("batch_set_v1", keys, host_indices):
            return [False] * len(keys)
        if not self.is_writer:
            log.debug("rank is not SGLang's storage writer for this shard: %d pages not written", len(keys))
            return [False] * len(keys)
        idx = host_indices.tolist()
        pages = [(self._name(k), self._page_tensor(int(idx[i * self.page_size]))) for i, k in enumerate(keys)]
        return self._put(pages)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load ``keys`` into the host pool at ``host_indices``; a page that fails is a miss (False).

        Each page is read straight into its regions of the pool (one ``readv`` on a directory)
        and verified there. A page that fails its check answers False; SGLang loads only the
        pages before the first False and frees the slots of the rest, so bytes that failed are
        never used. Encrypted stores (and pages of more than ``MAX_REGIONS`` regions) are read
        into one staging buffer and copied with SGLang's own ``set_from_flat_data_page``.
        """
        if not self._check_indices("batch_get_v1", keys, host_indices):
            return [False] * len(keys)
        import numpy as np
        import torch

        pool = self.mem_pool_host
        idx = host_indices.tolist()
        starts = [int(idx[i * self.page_size]) for i in range(len(keys))]
        views = [self._page_tensor(s) for s in starts]
        regions = [self._views.regions(v) if self._in_place else None for v in views]
        direct = [r is not None for r in regions]
        page_bytes = views[0].numel() * views[0].element_size() if views else 0
        n_staged = len(keys) - sum(direct)
        with self._lock:  # reuse warm memory between calls (each get gets its own while in use)
            buf, self._get_staging = self._get_staging, None
        if n_staged and (buf is None or buf.size < n_staged * page_bytes):
            buf = np.empty(n_staged * page_bytes, dtype=np.uint8)
        staging = buf[: n_staged * page_bytes].reshape(n_staged, page_bytes) if n_staged else None
        out: list[Any] = []
        slots: list[int | None] = []
        j = 0
        for reg in regions:
            if reg is not None:
                out.append(reg[0] if len(reg) == 1 else Scatter(*reg))
                slots.append(None)
            else:
                out.append(memoryview(staging[j]))
                slots.append(j)
                j += 1
        names = [self._name(k) for k in keys]
        t0 = time.perf_counter()
        results = self.store.get_many(names, out)
        ok = [r.error is None and r.size == page_bytes for r in results]
        for i, r in enumerate(results):
            if r.error is not None:
                log.warning("kvbucket HiCache: page %s not loaded: %s", keys[i], r.error)
        for i, slot in enumerate(slots):
            if ok[i] and slot is not None:
                pool.set_from_flat_data_page(starts[i], torch.from_numpy(staging[slot]).view(pool.dtype))
        if buf is not None:
            with self._lock:
                self._get_staging = buf
        self._remember([n for n, good in zip(names, ok, strict=True) if good])
        if self._fleet is not None:
            self._fleet.accessed([n for n, good in zip(names, ok, strict=True) if good])
        self._forget([n for n, r in zip(names, results, strict=True) if r.error is None and r.size is None])
        self._record("get", sum(ok), sum(ok) * page_bytes, time.perf_counter() - t0)
        return ok

    def _check_indices(self, op: str, keys: list[str], host_indices: Any) -> bool:
        if self.mem_pool_host is None:
            raise ConfigError(f"{op} before register_mem_pool_host: SGLang registers its host pool first")
        if host_indices is None or host_indices.numel() != len(keys) * self.page_size:
            log.error("%s: %d keys need %d host indices, got %s", op, len(keys), len(keys) * self.page_size,
                      None if host_indices is None else host_indices.numel())
            return False
        return True

    # -- tensor API (SGLang's generic, copying path)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read pages into ``target_locations`` (flat tensors; default: the host pool's dummy page)."""
        import torch

        if target_locations is None:
            if self.mem_pool_host is None:
                raise ConfigError("batch_get without target tensors needs the host pool registered first")
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        targets = [t if t.is_contiguous() else t.contiguous() for t in target_locations]
        out = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in targets]
        names = [self._name(k) for k in keys]
        t0 = time.perf_counter()
        results = self.store.get_many(names, out)
        answer: list[Any] = []
        for t, orig, r, buf in zip(targets, target_locations, results, out, strict=True):
            good = r.error is None and r.size == buf.nbytes
            if good and t is not orig:
                orig.copy_(t)
            answer.append(orig if good else None)
        n = sum(a is not None for a in answer)
        self._remember([nm for nm, a in zip(names, answer, strict=True) if a is not None])
        if self._fleet is not None:
            self._fleet.accessed([nm for nm, a in zip(names, answer, strict=True) if a is not None])
        self._record("get", n, sum(b.nbytes for b, a in zip(out, answer, strict=True) if a is not None),
                     time.perf_counter() - t0)
        return answer

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one tensor per key")
        if not self.is_writer:
            return False
        return all(self._put([(self._name(k), v) for k, v in zip(keys, values, strict=True)]))

    def _put(self, pages: list[tuple[str, Any]]) -> list[bool]:
        with self._lock:
            todo = [i for i, (n, _) in enumerate(pages) if n not in self._known]
        ok = [True] * len(pages)
        if not todo:
            return ok
        if self._fleet is not None:  # the fleet's write cap: a refused page is a failed set
            kept = self._fleet.admit([pages[i][1].numel() * pages[i][1].element_size() for i in todo])
            for i in todo[kept:]:
                ok[i] = False
                _repeated.log(logging.WARNING, "kvbucket HiCache: page %s " + REFUSED, pages[i][0],
                              item=pages[i][0])
            todo = todo[:kept]
            if not todo:
                return ok
        t0 = time.perf_counter()
        items: list[tuple[str, Any]] = []
        staged: list[int] = []
        for k, i in enumerate(todo):  # the pool's own regions, written with no copy (writev)
            reg = self._views.regions(pages[i][1].detach())
            items.append((pages[i][0], Gather(*reg) if reg is not None else None))
            if reg is None:
                staged.append(k)
        if not staged:
            results = self.store.put_many(items)
        else:
            with self._stage_lock:  # one reused staging buffer: no fresh allocation per page
                packed = self._stage([pages[todo[k]] for k in staged])
                for k, item in zip(staged, packed, strict=True):
                    items[k] = item
                results = self.store.put_many(items)
        for i, r in zip(todo, results, strict=True):
            ok[i] = r.error is None
            if r.error is not None:
                log.warning("kvbucket HiCache: page %s not stored: %s", pages[i][0], r.error)
        stored = [(items[k][0], r.size or 0) for k, r in enumerate(results) if r.error is None]
        self._remember([n for n, _ in stored])
        if stored and self.manifest is not None:
            self.manifest.record()  # once: this identity wrote here
        if self._fleet is not None:
            self._fleet.stored([n for n, _ in stored], [size for _, size in stored])
        self._record("set", len(stored), sum(size for _, size in stored), time.perf_counter() - t0)
        return ok

    # -- housekeeping
    def clear(self) -> bool:
        """Delete this shard's pages (all layouts) from the store."""
        names = [info.name for info in self.store.list(self._base + "/")]
        for i in range(0, len(names), 1000):
            results = self.store.delete_many(names[i : i + 1000])
            if self._fleet is not None:
                self._fleet.deleted([r.name for r in results if r.ok])
        with self._lock:
            self._known.clear()
        return True

    def close(self) -> None:
        if self._fleet is not None:
            self._fleet.close()  # publishes its last journal
            self._fleet = None
        self.store.close()

    def _record(self, op: str, pages: int, nbytes: int, seconds: float) -> None:
        if not pages:
            return
        with self._lock:
            self._stats[f"{op}_pages"].append(pages)
            self._stats[f"{op}_bw"].append(nbytes / 1e9 / max(seconds, 1e-9))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch).

        kvbucket's own Prometheus metrics (``kvbucket_store_*{store="<store URL>"}``,
        ``kvbucket_integrity_*{tier="sglang"}``) are in the default registry that SGLang's
        ``/metrics`` endpoint serves.
        """
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            s, self._stats = self._stats, {"get_pages": [], "set_pages": [], "get_bw": [], "set_bw": []}
        return StorageMetrics(prefetch_pgs=s["get_pages"], backup_pgs=s["set_pages"],
                              prefetch_bandwidth=s["get_bw"], backup_bandwidth=s["set_bw"])


__all__ = ["HAVE_SGLANG", "KVBucketHiCacheStorage", "SGLangStorageSettings", "layout_segment",
           "salt_segment", "shard_segment"]
