"""Non-MP mode: :class:`KVBucketConnector`, LMCache's ``RemoteConnector`` over a kvbucket object
store, loaded through ``remote_storage_plugins`` from ``kvbucket.integrations.lmcache`` (see that
package's docstring), and the ``remote_storage_plugin.<name>.*`` keys it reads."""

from __future__ import annotations

import asyncio
import builtins
import logging
import shutil
import time
from typing import TYPE_CHECKING, Any

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from pydantic import ValidationError

from kvbucket.did_you_mean import closest
from kvbucket.errors import CircuitOpenError, ConfigError, SizeMismatchError, StoreError
from kvbucket.keys import as_key_string
from kvbucket.l2.config import (
    FsL2Config,
    HFBucketL2Config,
    L2CommonConfig,
    S3L2Config,
    format_validation_error,
)
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.l2.format_store import route_formats
from kvbucket.l2.naming import watch_identities
from kvbucket.l2.registry import build_store, instrumented, make_work_dir, naming_for
from kvbucket.log_once import RepeatedLog
from kvbucket.metrics_server import MetricsServer, serve_metrics
from kvbucket.stores.base import ItemResult, ObjectStore
from kvbucket.stores.guard.read_ahead import read_ahead, with_read_ahead
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import lenient_bool
from kvbucket.stores.part_sizes import PART_SIZE_KEYS

if TYPE_CHECKING:
    from kvbucket.fleet.member import StoreFleet

log = logging.getLogger("kvbucket.integrations.lmcache")
_repeated = RepeatedLog(log)  # one line per kind of failure, with a count


_PLUGIN_CONTROL_KEYS = {"module_path", "class_name"}
# Where LMCache configs load the connector from (the package re-exports it), or this module.
_MODULE_PATHS = ("kvbucket.integrations.lmcache", __name__)


def connector_config_from_extra(extra_config: dict[str, Any] | None, plugin_name: str) -> L2CommonConfig:
    """The kvbucket store config for ``remote_storage_plugin.<plugin_name>.*`` keys.

    Booleans and numbers are read as leniently as LMCache reads them (``"yes"``, ``"30"``);
    unknown keys and wrong types are errors naming the key.
    """
    prefix = f"remote_storage_plugin.{plugin_name}."
    keys = {
        k[len(prefix) :]: v
        for k, v in (extra_config or {}).items()
        if isinstance(k, str) and k.startswith(prefix) and "." not in k[len(prefix) :]
    }
    d = {k: v for k, v in keys.items() if k not in _PLUGIN_CONTROL_KEYS}
    handle = d.pop("bucket_handle", None)
    where = f"extra_config {prefix}*"
    if not isinstance(handle, str) or not handle:
        typo = next((k for k in d if closest(k, ["bucket_handle"])), None)
        if typo is not None:  # a misspelt bucket_handle, not a missing one
            raise ConfigError(f"{where}: unknown key {prefix}{typo}: did you mean {prefix}bucket_handle?")
        raise ConfigError(
            f"{where}: {prefix}bucket_handle is required (hf://buckets/<ns>/<bucket>[/<prefix>], "
            "s3://<bucket>[/<prefix>] or file:///<dir>)"
        )
    cls: type[L2CommonConfig]
    if handle.startswith("hf://"):
        cls, d["bucket_handle"] = HFBucketL2Config, handle
    elif handle.startswith("s3://"):
        cls, d["s3_endpoint"] = S3L2Config, handle
    elif handle.startswith("file://"):
        cls, d["base_path"] = FsL2Config, handle[len("file://") :]
    else:
        raise ConfigError(f"{where}: bucket_handle must start with hf://, s3:// or file://")
    d = {k: _lenient(cls, prefix + k, k, v) for k, v in d.items()}
    try:
        return cls.model_validate(d)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where, cls)) from None


def _lenient(cls: type[L2CommonConfig], full_key: str, key: str, value: Any) -> Any:
    """LMCache reads plugin options leniently (YAML/env strings "30", "yes", "off"); do the same for
    booleans and numbers, and let the strict model reject anything else by name."""
    field = cls.model_fields.get(key)
    if field is None or key in PART_SIZE_KEYS:
        return value  # unknown: the model names it; a part size: its own parser (part_sizes.py)
    kinds = {field.annotation} | set(getattr(field.annotation, "__args__", ()))
    if bool in kinds:
        return lenient_bool(full_key, value)
    if isinstance(value, str) and (int in kinds or float in kinds):
        try:
            return int(value.strip()) if int in kinds else float(value.strip())
        except ValueError:
            raise ConfigError(f"{full_key} must be a number, got {value!r}") from None
    return value


def _own_plugin_names(config: Any) -> list[str]:
    extra = getattr(config, "extra_config", None) or {}
    names = []
    for name in getattr(config, "remote_storage_plugins", None) or []:
        if (
            extra.get(f"remote_storage_plugin.{name}.module_path") in _MODULE_PATHS
            and extra.get(f"remote_storage_plugin.{name}.class_name") == "KVBucketConnector"
        ):
            names.append(name)
    return names


class KVBucketConnector(RemoteConnector):
    """LMCache's non-MP ``RemoteConnector`` over a kvbucket object store.

    LMCache builds a plugin connector as ``cls(loop=, local_cpu_backend=, config=)`` without
    telling it its plugin name, so the name is found in ``config.remote_storage_plugins`` (the
    entry whose ``module_path``/``class_name`` point here); configure at most one such entry per
    engine, or pass ``plugin_name=`` when constructing it yourself.

    Only full chunks are stored (``save_unfull_chunk`` must be false) and objects hold raw chunk
    bytes (``save_chunk_meta`` must be false or unset). A stored object whose size is not the
    full chunk is never loaded.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        local_cpu_backend: Any = None,
        config: Any = None,
        metadata: Any = None,
        plugin_name: str | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        if config is None:
            raise ConfigError("KVBucketConnector needs the LMCache engine config")
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise ConfigError("KVBucketConnector needs LMCache metadata (from the local CPU backend)")
        extra = dict(getattr(config, "extra_config", None) or {})
        if extra.get("save_chunk_meta") is True:
            raise ConfigError(
                "KVBucketConnector stores raw chunk bytes: set extra_config.save_chunk_meta: false"
            )
        if getattr(config, "save_unfull_chunk", False):
            raise ConfigError("KVBucketConnector stores full chunks only: set save_unfull_chunk: false")
        extra["save_chunk_meta"] = False
        config_view = _ConfigView(config, extra)
        super().__init__(config_view, metadata)
        if plugin_name is None:
            names = _own_plugin_names(config)
            if len(names) != 1:
                raise ConfigError(
                    "KVBucketConnector could not tell which remote_storage_plugins entry it is "
                    f"(found {names or 'none'}); LMCache does not pass the name to plugin connectors, so "
                    "configure exactly one entry with class_name KVBucketConnector"
                )
            plugin_name = names[0]
        self.plugin_name = plugin_name
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._cfg = connector_config_from_extra(extra, plugin_name)
        if self._cfg.fleet is None and (self._cfg.max_capacity_gb or self._cfg.eviction is not None):
            raise ConfigError(
                f"remote_storage_plugin.{plugin_name}: max_capacity_gb and eviction need a "
                f"remote_storage_plugin.{plugin_name}.fleet object on the non-MP connector (it keeps no "
                "index of its own; the fleet counts the whole prefix: add fleet: {} for the defaults)"
            )
        self.metrics = self._serve_metrics(metadata)  # before the store opens: nothing to undo
        self.naming = naming_for(self._cfg, connector=True)
        # Sealed like every persistent tier: writes go through SealedStore.put_many, loads are
        # verified before LMCache gets the memory object (kvbucket.stores.guard.sealed); objects under
        # LMCache's names stay raw, exactly LMCache's bytes (kvbucket.l2.format_store).
        raw = instrumented(store if store is not None else build_store(self._cfg))
        sealed = seal_store(
            raw, tier="connector", unsealed=self._cfg.unsealed, encryption=self._cfg.encryption
        )
        # A lookup hit starts its load (read-ahead, kvbucket.stores.guard.read_ahead); every verb goes
        # through the buffer, so a store or delete drops what it replaces.
        self.store = with_read_ahead(route_formats(sealed, self.naming), self._cfg.read_ahead_settings(),
                                     label=raw.url)
        key = f"remote_storage_plugin.{plugin_name}"  # in LMCache's extra_config
        watch_identities(self.naming, raw, f"kvbucket connector {plugin_name!r}",
                         f"{key}.model_identity (LMCache's extra_config)", f"{key}.accept_name_only")
        self._fleet: StoreFleet | None = None
        if self._cfg.fleet is not None:
            from kvbucket.fleet.member import StoreFleet

            self._fleet = StoreFleet(
                raw, self.store, self._cfg.fleet, capacity=self._cfg.max_capacity_bytes,
                eviction=self._cfg.eviction or EvictionConfig(),
                parse_key_string=self.naming.parse_key_string,
            )
        # LMCache's connector makes a download session dir in download_tmp_dir, removed on close.
        self.work_dir = make_work_dir(self._cfg, f"hfbucket-{plugin_name.replace('.', '-')}-")
        self._ttl = self._cfg.metadata_cache_ttl_secs
        self._sizes: dict[str, tuple[int | None, float]] = {}  # name -> (size, expiry)
        self.lookup_failures = 0  # names a lookup answered as misses because the store failed
        log.info("kvbucket connector %r on %s", plugin_name, self.store.url)

    def _serve_metrics(self, metadata: Any) -> MetricsServer | None:
        """``metrics_port``: LMCache builds one connector per GPU worker process, so each serves
        on ``metrics_port`` + its ``local_worker_id``; a scheduler's connector (lookups only)
        serves none."""
        port = self._cfg.metrics_port
        if port is None:
            return None
        if getattr(metadata, "role", None) == "scheduler":
            return None
        port += int(getattr(metadata, "local_worker_id", 0) or 0)
        setting = f"remote_storage_plugin.{self.plugin_name}.metrics_port"
        return serve_metrics(port, self._cfg.metrics_addr, setting=setting)

    # -- helpers
    def _name(self, key: Any) -> str:
        return self.naming.write_name(key)

    def _found(self, keys: builtins.list[Any]) -> tuple[builtins.list[tuple[str, int | None]], set[int]]:
        """Per key, the first of its names holding an object, with its size (or its written
        name and None): kvbucket's and LMCache's names are both read. Also the indexes of the
        keys the store could not answer for (hung, down, breaker open): misses, never errors."""
        if self.naming.identity.unknown(len(keys)):  # not known yet (IdentityPending): misses
            return [("", None)] * len(keys), set(range(len(keys)))
        cands = [self.naming.read_names(k) for k in keys]
        out: builtins.list[tuple[str, int | None]] = [(c[0], None) for c in cands]
        failed: set[int] = set()
        todo = list(range(len(keys)))
        r = 0
        while todo:
            sizes = self._sizes_of([cands[i][r] for i in todo])
            nxt = []
            for i, size in zip(todo, sizes, strict=True):
                if isinstance(size, StoreError):
                    failed.add(i)
                elif size is not None:
                    out[i] = (cands[i][r], size)
                elif r + 1 < len(cands[i]):
                    nxt.append(i)
            todo, r = nxt, r + 1
        return out, failed

    def _sizes_of(self, names: list[str]) -> list[int | StoreError | None]:
        """Sizes of ``names`` (None: missing), remembered for ``metadata_cache_ttl_secs``; the
        error of a name the store could not answer for (logged once per kind, not remembered)."""
        now = time.monotonic()
        out: dict[str, int | StoreError | None] = {}
        ask = []
        for n in names:
            hit = self._sizes.get(n)
            if hit is not None and hit[1] > now:
                out[n] = hit[0]
            else:
                ask.append(n)
        if ask:
            try:
                results = self.store.head_many(ask)
            except StoreError as e:
                results = [ItemResult(n, error=e) for n in ask]
            for r in results:
                if r.error is not None:
                    out[r.name] = r.error
                    self.lookup_failures += 1
                    if not isinstance(r.error, CircuitOpenError):  # the breaker logged when it opened
                        _repeated.warning(
                            "lookup on %s failed (%s: %s); answered as a miss", self.store.url,
                            type(r.error).__name__, r.error,
                            same=f"lookup on {self.store.url} failed: {type(r.error).__name__}",
                        )
                    continue
                out[r.name] = r.size
                self._sizes[r.name] = (r.size, now + self._ttl)
        return [out[n] for n in names]

    # -- RemoteConnector
    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: Any) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: builtins.list[Any]) -> int:
        """The number of leading keys stored as full chunks; their loads start now (read-ahead)."""
        hits: builtins.list[str] = []
        for name, size in self._found(keys)[0]:
            if size != self.full_chunk_size_bytes:
                break
            hits.append(name)
        read_ahead(self.store, hits, [self.full_chunk_size_bytes] * len(hits))
        return len(hits)

    async def batched_async_contains(
        self, lookup_id: str, keys: builtins.list[Any], pin: bool = False
    ) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: builtins.list[Any]) -> builtins.list[Any]:
        return await asyncio.to_thread(self._batched_get_sync, keys)

    def _batched_get_sync(self, keys: builtins.list[Any]) -> builtins.list[Any]:
        objs: builtins.list[Any] = []
        for _ in keys:
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            objs.append(obj)
        found, failed = self._found(keys)
        names = [name for name, _ in found]
        # A key whose lookup just failed is a miss at once (the store did not answer; its load
        # would only cost the load deadline again).
        todo = [i for i, o in enumerate(objs) if o is not None and i not in failed]
        for i in failed:
            if objs[i] is not None:
                objs[i].ref_count_down()
        results = self.store.get_many([names[i] for i in todo], [objs[i].byte_array for i in todo])
        if self._fleet is not None:
            self._fleet.accessed([r.name for r in results if r.found])
        out: builtins.list[Any] = [None] * len(keys)
        for i, r in zip(todo, results, strict=True):
            if r.found:
                out[i] = objs[i]
                self._sizes[names[i]] = (r.size, time.monotonic() + self._ttl)
                continue
            if isinstance(r.error, SizeMismatchError):
                log.warning("not loading %s: %s", names[i], r.error)
            elif r.error is not None:
                log.warning("load of %s failed: %s", names[i], r.error)
            else:
                self._sizes.pop(names[i], None)
            objs[i].ref_count_down()
        return out

    async def batched_get_non_blocking(self, lookup_id: str, keys: builtins.list[Any]) -> builtins.list[Any]:
        results = await self.batched_get(keys)
        prefix: builtins.list[Any] = []
        for j, obj in enumerate(results):
            if obj is None:
                for rest in results[j + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            prefix.append(obj)
        return prefix

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: builtins.list[Any], memory_objs: builtins.list[Any]) -> None:
        await asyncio.to_thread(self._batched_put_sync, keys, memory_objs)

    def _batched_put_sync(self, keys: builtins.list[Any], memory_objs: builtins.list[Any]) -> None:
        if len(keys) != len(memory_objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(memory_objs)} chunks")
        if self.naming.identity.unknown():  # not known yet: dropped, counted, never a guessed name
            self.naming.identity.pending_refused += len(keys)
            return
        items = []
        for key, obj in zip(keys, memory_objs, strict=True):
            data = obj.byte_array
            size = memoryview(data).nbytes  # what is stored (LMCache checks get_physical_size(),
            # which includes allocator padding and so refuses full chunks smaller than the alignment)
            if size != self.full_chunk_size_bytes:
                # LMCache's hfbucket connector raises here, before anything of the batch is sent.
                raise ValueError(
                    f"Cannot upload {as_key_string(key)}: chunk size {size} bytes does not match "
                    f"expected full chunk size {self.full_chunk_size_bytes} bytes. "
                    "Partial/unfull chunks are not supported by kvbucket's connector "
                    "(set save_unfull_chunk: false)."
                )
            items.append(self.naming.write_item(key, data))
        refused = 0
        if self._fleet is not None:  # the fleet's write cap (docs/fleet.md)
            kept = self._fleet.admit([self.full_chunk_size_bytes] * len(items))
            refused, items = len(items) - kept, items[:kept]
        results = self.store.put_many(items) if items else []
        if self._fleet is not None:
            landed = [r.name for r in results if r.ok]
            self._fleet.stored(landed, [self.full_chunk_size_bytes] * len(landed))
        now = time.monotonic()
        errors = []
        for r in results:
            if r.ok:
                self._sizes[r.name] = (r.size, now + self._ttl)
            else:
                self._sizes.pop(r.name, None)
                errors.append(r)
        if errors:
            raise StoreError(
                f"{len(errors) + refused} of {len(keys)} chunks were not stored; first: {errors[0].error}"
            )
        if refused:
            raise StoreError(
                f"{refused} of {len(keys)} chunks were not stored: the shared prefix is at its fleet "
                "write cap (max_capacity_gb * fleet.write_cap; eviction makes room within a few sync rounds)"
            )

    def remove_sync(self, key: Any) -> bool:
        names = self.naming.read_names(key)
        results = self.store.delete_many(list(names))
        for name in names:
            self._sizes.pop(name, None)
        if self._fleet is not None:
            self._fleet.deleted([r.name for r in results if r.ok])
        return all(r.ok for r in results) and any(r.size is not None for r in results)

    async def list(self) -> builtins.list[str]:
        return await asyncio.to_thread(self._list_sync)

    def _list_sync(self) -> builtins.list[str]:
        if self.naming.identity.unknown():
            return []
        out = []
        for info in self.store.list():
            key = self.naming.parse_key_string(info.name)  # kvbucket's names and LMCache's
            if key is not None:
                out.append(key)
        return out

    async def close(self) -> None:
        if self._fleet is not None:
            await asyncio.to_thread(self._fleet.close)  # publishes its last journal
        await asyncio.to_thread(self.store.close)
        if self.work_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.work_dir, True)

    def __repr__(self) -> str:
        return f"<KVBucketConnector {self.plugin_name!r} {self.store.url}>"


class _ConfigView:
    """The engine config with a normalised ``extra_config`` (LMCache reads ``save_chunk_meta``
    there), without mutating the caller's config object."""

    def __init__(self, config: Any, extra: dict[str, Any]) -> None:
        self._config = config
        self.extra_config = extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

