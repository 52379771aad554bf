"""kvbucket as a secondary tier of vLLM's multi-tier KV offloading (a bucket behind the CPU tier).

vLLM (0.33) loads it through its own ``TieringOffloadingSpec``: the ``OffloadingConnector`` keeps
a CPU primary tier, and every chunk stored there is cascaded to each secondary tier; a chunk
found only in a secondary tier is promoted back into the CPU tier before the GPU reads it::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{"type": "KVBucketSecondaryTier",
                             "module_path": "kvbucket.integrations.vllm",
                             "store_url": "hf://buckets/my-org/kv-cache"}]}}'

A secondary tier never touches GPU memory: vLLM hands it a ``memoryview`` of the CPU tier's
chunks and asks it to move whole chunks (``chunk_ids``) to and from its storage, asynchronously,
from the scheduler process. Each chunk is one sealed object (a failed check is a miss) named

    ``<prefix>/<model>~<identity>/<salt>/<parallel>-<layout digest>/<block hash>-g<group>``

- ``identity``: the model's identity token (weights, attention config, KV dtype:
  :mod:`kvbucket.integrations.engine_identity`), so a redeploy under the same name with other
  weights, revision or ``rope_scaling`` never reads the old chunks (a miss, nothing deleted).

- ``block hash``/``group``: vLLM's own ``OffloadKey``. vLLM chains block hashes over the prompt
  and mixes a request's ``cache_salt`` (and LoRA, multimodal inputs) into them, so per-request
  salts already give other names; the tier is never told the salt and needs not be.
- ``salt``: the tier's ``cache_salt`` setting (hashed), a deployment-wide namespace.
- ``parallel``/``layout digest``: a chunk holds the KV of every worker of the engine
  (``|W0|W1|..|``), so there is no per-rank object; the names carry what vLLM's own ``fs`` tier
  hashes (its ``FileMapper``: model, dtype, tokens per hash, blocks per chunk, tp/pp/pcp/dcp
  sizes unless vLLM certifies the bytes as parallelism-agnostic, KV cache groups and layers,
  canonical format) plus the chunk's byte size and the KV cache layout.

Lookups follow vLLM's async protocol (``RETRY`` until a background batch answers) with vLLM's
own ``AsyncLookupManager``; a batch is answered from what this tier knows (its stores, its loads,
a listing) and, for the rest, one batched ``head_many``, except on S3 where every HEAD is a request:
there the tier answers from a listing of its namespace, refreshed every ``index_refresh_secs``.

With ``fleet`` (and ``max_capacity_gb``, ``eviction``) the engines on one store share one
capacity, fleet-wide eviction, ``max_age_secs`` and pins (:mod:`kvbucket.integrations.engine_fleet`);
a chunk the fleet refuses fails its store job, like a full disk. With ``enable_kv_events``, a chunk
the fleet deletes that this tier reported stored gets one removed event.

This module imports without vLLM (kvbucket does not depend on it); creating the tier needs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any, ClassVar, Literal

from pydantic import Field

from kvbucket.errors import ConfigError
from kvbucket.identity.core import qualify
from kvbucket.identity.manifest import Manifest
from kvbucket.integrations.engine_fleet import REFUSED, open_fleet
from kvbucket.integrations.engine_settings import EngineTierSettings
from kvbucket.integrations.naming import path_segment, salt_segment
from kvbucket.integrations.vllm_identity import tier_identity
from kvbucket.log_once import RepeatedLog
from kvbucket.metrics_server import MetricsEndpointConfig, serve_metrics
from kvbucket.stores.guard.read_ahead import PrefetchStore, read_ahead, with_read_ahead

log = logging.getLogger(__name__)
_repeated = RepeatedLog(log)

try:  # vLLM is optional: the classes below subclass its interfaces when it is installed.
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        get_offload_block_hash,
        get_offload_group_idx,
        make_offload_key,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager as _LookupBase
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        RequestOffloadingContext,
        ScheduleEndContext,
        TransferJob,
    )
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as _TierBase

    HAVE_VLLM = True
except ImportError:  # pragma: no cover - depends on the venv
    HAVE_VLLM = False
    OffloadKey = bytes  # type: ignore[misc,assignment]
    ReqContext = TransferJob = ScheduleEndContext = Any  # type: ignore[misc,assignment]

    class _TierBase:  # type: ignore[no-redef]
        """Stands in for vLLM's ``SecondaryTierManager`` when vLLM is not installed."""

    class _LookupBase:  # type: ignore[no-redef]
        """Stands in for vLLM's ``AsyncLookupManager`` when vLLM is not installed."""


_MIN_PART = 8  # chunks: a directory job of fewer is not split over threads


class VLLMTierSettings(EngineTierSettings, MetricsEndpointConfig):
    """kvbucket's keys of one ``secondary_tiers`` entry (besides vLLM's ``type``/``module_path``),
    with the store, fleet and read-ahead keys of every engine tier and the metrics endpoint's
    (``metrics_port``, ``metrics_addr``)."""

    cache_salt: str = Field("", description="deployment-wide namespace: other salts never see these chunks")
    prefix: str = Field("vllm", description="first path segment of every chunk object")
    lookup: Literal["auto", "head", "index"] = Field(
        "auto", description="head: batched head_many for chunks not known; index: a listing only; "
        "auto: index on s3://, head elsewhere")
    index_refresh_secs: float = Field(60.0, ge=0, description="index lookups: relist this often (0: never)")
    miss_ttl_secs: float = Field(2.0, ge=0, description="head lookups: a miss is remembered this long")
    known_chunks: int = Field(262144, ge=0, description="chunk names remembered as stored")
    load_threads: int = Field(4, ge=1, description="concurrent load (promotion) jobs")
    store_threads: int = Field(2, ge=1, description="concurrent store (cascade) jobs")
    io_threads: int = Field(4, ge=1, description="directory stores: threads sharing one job's objects")
    enable_kv_events: bool = Field(False, description="emit vLLM KV events: BlockStored for chunks stored "
                                   "here, BlockRemoved when the fleet deletes one of them")
    locality: Literal["LOCAL", "REMOTE"] | None = Field(None, description="vLLM's locality of this tier")
    quantization: str | None = Field(None, description="the --quantization vLLM runs with (found on its "
                                     "scheduler's stack when not set; kvbucket.integrations.vllm_identity)")

    @classmethod
    def from_tier_config(cls, config: dict[str, Any]) -> VLLMTierSettings:
        return cls.validated(
            config, invalid="invalid kvbucket vLLM tier settings",
            no_store_url="the kvbucket vLLM tier needs \"store_url\" in its secondary_tiers entry, "
            "e.g. {\"type\": \"KVBucketSecondaryTier\", \"module_path\": \"kvbucket.integrations.vllm\", "
            "\"store_url\": \"hf://buckets/my-org/kv-cache\"}")


def namespace(spec: Any, block_size_bytes: int, settings: VLLMTierSettings, token: str | None = None) -> str:
    """The object-name prefix of one engine configuration (see the module docstring)."""
    mapper = FileMapper.from_offloading_spec("", spec, blocks_per_file=spec.blocks_per_chunk,
                                             parallel_agnostic=True)
    fields = dict(mapper.get_run_config())
    fields.update(chunk_bytes=block_size_bytes, kv_cache_layout=spec.config.kv_cache_layout,
                  kvbucket_format=1)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if fields.get("parallel_agnostic") is False:
        par = "tp{tp_size}-pp{pp_size}-pcp{pcp_size}-dcp{dcp_size}".format(**fields)
    else:  # vLLM certified the bytes as the same under any parallel layout
        par = "anytp"
    return "/".join((path_segment(settings.prefix), qualify(path_segment(spec.config.model.name), token),
                     salt_segment(settings.cache_salt, "vllm"), f"{par}-{digest}"))


class _KnownChunks:
    """Keys known stored (bounded, least recently added dropped first) and recent misses."""

    def __init__(self, limit: int, miss_ttl: float) -> None:
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._missing: OrderedDict[bytes, float] = OrderedDict()  # key -> expiry, oldest first
        self._limit, self._ttl = limit, miss_ttl
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._present)

    def add(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._present[k] = None
                self._present.move_to_end(k)
                self._missing.pop(k, None)
            while len(self._present) > self._limit:
                self._present.popitem(last=False)

    def discard(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._present.pop(k, None)

    def miss(self, keys: Iterable[bytes]) -> None:
        if not self._ttl:
            return
        until = time.monotonic() + self._ttl
        with self._lock:
            for k in keys:
                self._missing[k] = until
                self._missing.move_to_end(k)

    def state(self, keys: Sequence[bytes]) -> list[bool | None]:
        """True: known stored; False: a recent miss; None: unknown."""
        now = time.monotonic()
        with self._lock:
            while self._missing and next(iter(self._missing.values())) <= now:
                self._missing.popitem(last=False)
            return [True if k in self._present else (False if k in self._missing else None) for k in keys]


class _Lookup(_LookupBase):
    """vLLM's async lookup front end; the batches run on its background thread."""

    def __init__(self, tier: KVBucketSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.exists(keys)


class KVBucketSecondaryTier(_TierBase):
    """vLLM ``SecondaryTierManager`` over any kvbucket store (see the module docstring)."""

    medium: ClassVar[Any] = Medium.STORAGE if HAVE_VLLM else None

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **config: Any) -> None:
        if not HAVE_VLLM:
            raise ConfigError("kvbucket.integrations.vllm needs vLLM: pip install vllm")
        import numpy as np

        from kvbucket.metrics import InstrumentedStore
        from kvbucket.stores import open_store
        from kvbucket.stores.guard.sealed import seal_store
        from kvbucket.threads import DaemonThreadPool

        self.settings = s = VLLMTierSettings.from_tier_config(config)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Once per process and port, up while the process runs (several tiers share it); before the
        # store opens, so a port another process holds (a ConfigError naming metrics_port) leaves
        # nothing to close.
        self.metrics = None if s.metrics_port is None else serve_metrics(s.metrics_port, s.metrics_addr)
        self.locality = Locality(s.locality) if s.locality else None
        bs = self.block_size_bytes
        self._chunks = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, bs)
        model = offloading_spec.config.model
        # From what vLLM hands over: the model's files, KV dtype and length (+ launch extras).
        self.identity = tier_identity(model, s, s.quantization)
        self.namespace = namespace(offloading_spec, bs, s, self.identity.token if self.identity else None)
        self._raw = open_store(s.store_url, **s.store_options)
        self.manifest = None if self.identity is None else Manifest(
            self._raw, path_segment(s.prefix), self.identity, "kvbucket vLLM tier",
            model_key=path_segment(model.name))
        if self.manifest is not None:
            self.manifest.start()
        # Lookup hits start their loads (read-ahead, kvbucket.stores.guard.read_ahead), behind the check.
        # The store's series (requests, read-ahead) carry its URL, as its circuit breaker's do.
        self.store = with_read_ahead(
            seal_store(InstrumentedStore(self._raw, name=self._raw.url), tier="vllm", unsealed=s.unsealed,
                       encryption=s.encryption),
            s.read_ahead_settings(), label=self._raw.url)
        auto = "index" if s.store_url.startswith("s3://") else "head"  # S3: one request per HEAD
        self.lookup_mode = auto if s.lookup == "auto" else s.lookup
        self.known = _KnownChunks(s.known_chunks, s.miss_ttl_secs)
        self.events: list[Any] | None = (
            [] if s.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._loads = DaemonThreadPool(s.load_threads, thread_name_prefix="kvbucket-vllm-load")
        self._stores = DaemonThreadPool(s.store_threads, thread_name_prefix="kvbucket-vllm-store")
        # A directory store reads and writes a batch one object after the other; remote stores
        # run a batch concurrently themselves (and a Hub batch is one commit): only the former
        # get a job split over threads.
        local = "://" not in s.store_url or s.store_url.startswith("file://")
        self._io = DaemonThreadPool(s.io_threads, thread_name_prefix="kvbucket-vllm-io") if local else None
        self._lock = threading.Lock()
        self._reported: set[bytes] = set()  # keys of stored events, until their removed event
        self._inflight: set[Future[Any]] = set()
        self._done: list[tuple[Any, list[Any]]] = []  # (JobResult, keys that failed to load)
        self._stop = threading.Event()
        self.listed = threading.Event()
        self._lookup = _Lookup(self)
        self._fleet = open_fleet(s, self._raw, self.store, self._gone)
        if self.lookup_mode == "index":
            threading.Thread(target=self._index_loop, name="kvbucket-vllm-index", daemon=True).start()
        log.info("kvbucket vLLM tier on %s (%s, %s lookups, %d bytes per chunk)", self.store.url,
                 self.namespace, self.lookup_mode, bs)

    # -- names
    def name(self, key: bytes) -> str:
        return f"{self.namespace}/{get_offload_block_hash(key).hex()}-g{get_offload_group_idx(key)}"

    def _key_of(self, name: str) -> bytes | None:
        leaf = name.rpartition("/")[2]
        digest, sep, group = leaf.rpartition("-g")
        try:
            return make_offload_key(bytes.fromhex(digest), int(group)) if sep else None
        except ValueError:
            return None

    def _gone(self, names: list[str]) -> None:
        """Chunks deleted anywhere in the fleet (its thread): no longer known stored here, and a
        removed event for each one this tier reported stored (vLLM's CPU tier emits one per
        eviction), so KV-event consumers stop routing to chunks that are gone."""
        mine = self.namespace + "/"  # the fleet may hold other engines' and namespaces' chunks
        keys = [k for n in names if n.startswith(mine) and (k := self._key_of(n)) is not None]
        self.known.discard(keys)
        if isinstance(self.store, PrefetchStore):
            self.store.forget(names)
        if self.events is None:
            return
        with self._lock:
            removed = [k for k in dict.fromkeys(keys) if k in self._reported]
            self._reported.difference_update(removed)
            if removed:
                self.events.append(OffloadingEvent(keys=removed, medium=self.medium, removed=True,
                                                   locality=self.locality))

    # -- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each chunk is stored: known ones without I/O, the rest by one batched lookup.
        Hits start loading now (read-ahead), for the load job vLLM submits next."""
        state = self.known.state(keys)
        unknown = [i for i, s in enumerate(state) if s is None]
        found = [s is True for s in state]
        if unknown and (self.lookup_mode == "head" or not self.listed.is_set()):
            results = self.store.head_many([self.name(keys[i]) for i in unknown])
            hits, misses = [], []
            for i, r in zip(unknown, results, strict=True):
                found[i] = r.found and r.size == self.block_size_bytes  # a foreign size is a miss
                if found[i]:
                    hits.append(keys[i])
                elif r.error is None:  # a failed lookup is a miss now, not remembered
                    misses.append(keys[i])
            self.known.add(hits)
            self.known.miss(misses)
        hit_names = [self.name(k) for k, f in zip(keys, found, strict=True) if f]
        read_ahead(self.store, hit_names, [self.block_size_bytes] * len(hit_names))
        return found

    def _index_loop(self) -> None:
        """List this namespace (at start, then every ``index_refresh_secs``) into the known chunks."""
        while not self._stop.is_set():
            t0, n = time.monotonic(), 0
            try:
                for info in self.store.list(self.namespace + "/"):
                    key = self._key_of(info.name)
                    if key is not None and info.size == self.block_size_bytes:
                        self.known.add((key,))
                        n += 1
                    if self._stop.is_set():
                        return
                log.info("kvbucket vLLM tier: %d chunks listed in %.1f s", n, time.monotonic() - t0)
                self.listed.set()
            except Exception as e:  # the tier keeps answering with HEADs until a listing works
                log.warning("kvbucket vLLM tier: listing %s failed: %s", self.namespace, e)
            wait_s = self.settings.index_refresh_secs if self.listed.is_set() else 5.0
            if not wait_s or self._stop.wait(wait_s):
                return

    # -- transfers (vLLM calls these under its manager lock: they only submit)
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunk_ids = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._stores, self._store_job, job_metadata.job_id, keys, chunk_ids)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, chunk_ids = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._loads, self._load_job, job_metadata.job_id, keys, chunk_ids)

    def _submit(self, pool: Any, fn: Any, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        fut = pool.submit(self._run, fn, job_id, keys, chunk_ids)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._finished)

    def _run(self, fn: Any, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> tuple[Any, list[Any]]:
        try:
            return fn(job_id, keys, chunk_ids)
        except Exception as e:  # a job always reports, or vLLM would keep its chunks pinned
            log.warning("kvbucket vLLM tier: job %d failed: %s", job_id, e)
            return JobResult(job_id=job_id, success=False), list(keys)

    def _finished(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)
            self._done.append(fut.result())

    def _store_job(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> tuple[Any, list[Any]]:
        t0 = time.perf_counter()
        state = self.known.state(keys)
        todo = [(k, c) for k, c, s in zip(keys, chunk_ids, state, strict=True) if s is not True]
        wanted = len(todo)
        if self._fleet is not None:  # the fleet's write cap: a refused chunk fails the job
            kept = self._fleet.admit([self.block_size_bytes] * len(todo))
            for k, _ in todo[kept:]:
                name = self.name(k)
                _repeated.log(logging.WARNING, "kvbucket vLLM tier: chunk %s " + REFUSED, name, item=name)
            todo = todo[:kept]
        items = [(self.name(k), memoryview(self._chunks[c])) for k, c in todo]
        results = self._split(self.store.put_many, items)
        stored = [k for (k, _), r in zip(todo, results, strict=True) if r.error is None]
        for (k, _), r in zip(todo, results, strict=True):
            if r.error is not None:
                log.warning("kvbucket vLLM tier: chunk %s not stored: %s", self.name(k), r.error)
        self.known.add(stored)
        if stored and self.manifest is not None:
            self.manifest.record()  # once: this identity wrote here (a no-op after the first time)
        if self.events is not None and stored:  # before the fleet hears of them: it may delete them
            with self._lock:
                self._reported.update(stored)
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                   locality=self.locality))
        if self._fleet is not None:
            self._fleet.stored([self.name(k) for k in stored], [self.block_size_bytes] * len(stored))
        return JobResult(job_id=job_id, success=len(stored) == wanted,
                         transfer_time=time.perf_counter() - t0,
                         transfer_bytes=len(stored) * self.block_size_bytes), []

    def _load_job(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> tuple[Any, list[Any]]:
        """Read chunks straight into their CPU-tier slots; one that fails is a miss (vLLM frees its
        slot: the bytes a failed check left there are never served)."""
        t0 = time.perf_counter()
        names = [self.name(k) for k in keys]
        pairs = [(n, memoryview(self._chunks[c])) for n, c in zip(names, chunk_ids, strict=True)]
        results = self._split(lambda part: self.store.get_many([n for n, _ in part], [b for _, b in part]),
                              pairs)
        good = [r.error is None and r.size == self.block_size_bytes for r in results]
        for n, r in zip(names, results, strict=True):
            if r.error is not None:
                log.warning("kvbucket vLLM tier: chunk %s not loaded: %s", n, r.error)
        loaded = [k for k, g in zip(keys, good, strict=True) if g]
        failed = [k for k, g in zip(keys, good, strict=True) if not g]
        self.known.add(loaded)
        if self._fleet is not None:
            self._fleet.accessed([n for n, g in zip(names, good, strict=True) if g])
        self.known.discard(failed)
        self.known.miss(failed)  # e.g. a damaged chunk: not fetched again for every request
        ok = not failed
        return JobResult(job_id=job_id, success=ok,
                         successful_keys=None if ok or not loaded else tuple(loaded),
                         transfer_time=time.perf_counter() - t0,
                         transfer_bytes=len(loaded) * self.block_size_bytes), failed

    def _split(self, fn: Any, items: list[Any]) -> list[Any]:
        """``fn(items)``, over the I/O threads in parts of at least _MIN_PART items where that helps."""
        if self._io is None or len(items) < 2 * _MIN_PART:
            return fn(items) if items else []
        n = min(self.settings.io_threads, len(items) // _MIN_PART)
        size = -(-len(items) // n)
        futures = [self._io.submit(fn, items[i : i + size]) for i in range(0, len(items), size)]
        return [r for f in futures for r in f.result()]

    def get_finished_jobs(self) -> Iterable[Any]:
        with self._lock:
            done, self._done = self._done, []
        for _, failed in done:
            if failed:  # vLLM stops re-promoting them for this request (its livelock guard)
                self._lookup.mark_miss(failed)
        return [result for result, _ in done]

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                pending = list(self._inflight)
            if not pending:
                return
            wait(pending)

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._done)

    # -- per request / per step
    def on_new_request(self, req_context: ReqContext) -> Any:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def take_events(self) -> Iterable[Any]:
        if self.events is None:
            return ()
        with self._lock:
            out, self.events = self.events, []
        return out

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvbucket_store", "kvbucket_lookup")

    def config_info(self) -> dict[str, Any]:
        return {"kvbucket_store": self.store.url, "kvbucket_lookup": self.lookup_mode}

    def shutdown(self) -> None:
        self._stop.set()
        self._lookup.shutdown()
        self.drain_jobs()
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self._fleet is not None:
            self._fleet.close()  # publishes its last journal
            self._fleet = None
        self.store.close()
        self._chunks = None  # our view of the CPU tier: vLLM unmaps it after the tiers shut down


__all__ = ["HAVE_VLLM", "KVBucketSecondaryTier", "VLLMTierSettings", "namespace"]
