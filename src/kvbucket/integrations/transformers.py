"""Prefix KV reuse for Hugging Face transformers causal LMs (extra ``kvbucket[transformers]``).

A prompt is cut into chunks of ``chunk_tokens`` tokens. Chunk *i*'s key is a chain hash over
the model's identity, its KV dtype and layout, a cache salt, and every token of chunks 0..i, so
a chunk is only ever reused after exactly the same prefix, by exactly the same model. The
longest run of stored chunks from the start of the prompt is loaded into a
:class:`~transformers.DynamicCache`; the model then computes only the remaining tokens. New
full chunks are written to the backend by a worker thread, so storing never delays the first
token (``flush()`` / ``close()`` wait for it).

Chunk layout is LMCache's: ``(layers, 2, chunk_tokens, kv_heads, head_size)`` in the model's
dtype, contiguous, so the bytes can be shared with other LMCache-layout consumers of the same
backend.

Usage::

    cache = KVBucketPrefixCache(model, backend, salt="tenant-a")
    out = cache.generate(input_ids, max_new_tokens=32)          # prefill + model.generate
    # or, keeping full control of generate():
    past = cache.prefill(input_ids)
    out = model.generate(input_ids, past_key_values=past, max_new_tokens=32)
    cache.close()                                               # flush pending stores

Supported: decoder-only models whose every layer uses a full-attention ``DynamicLayer``
(Llama, Qwen2/2.5/3, Mistral without sliding window, Phi-3, ...), batch size 1, any dtype,
GQA/MQA. Sliding-window, chunked-attention, hybrid/linear-attention and KV-sharing caches
are refused with an :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from kvbucket import metrics
from kvbucket.backends.base import StorageBackend
from kvbucket.errors import ConfigError, KVBucketError
from kvbucket.identity.core import qualify

# torch and DynamicCache come through transformers_model, whose import says how to install them
from kvbucket.integrations.transformers_model import (
    DEFAULT_CHUNK_TOKENS,
    DynamicCache,
    KVChunkLayout,
    UnsupportedModelError,
    as_batch1,
    as_token_list,
    as_u8,
    byte_len,
    check_cache_shape,
    check_mask,
    key_model_name,
    logits_to_keep_kwarg,
    model_fingerprint,
    model_identity,
    model_weights,
    new_dynamic_cache,
    np_view,
    probe_kv_layout,
    torch,
)
from kvbucket.keys import CacheEngineKey
from kvbucket.threads import DEFAULT_CLOSE_TIMEOUT_SECS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
#: How long ``KVBucketPrefixCache.close()`` waits for pending stores before dropping the rest.
DEFAULT_CLOSE_DRAIN_SECS = 30.0

_HASH_VERSION = b"kvbucket-transformers-prefix-v1"


@dataclass
class PrefillStats:
    """What one prefill did. Times are wall-clock seconds on the critical path.

    ``lookup_seconds`` is hashing the prompt into keys; ``load_seconds`` is fetching the chunks
    and building the cache from them; ``compute_seconds`` is the model's forward pass.
    """

    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    hit_chunks: int = 0
    bytes_loaded: int = 0
    chunks_queued: int = 0
    lookup_seconds: float = 0.0
    load_seconds: float = 0.0
    compute_seconds: float = 0.0


@dataclass
class StoreStats:
    """Background stores since the cache was created (``stored`` counts only what landed)."""

    queued: int = 0
    stored: int = 0
    failed: int = 0
    dropped: int = 0
    bytes_stored: int = 0


class KVBucketPrefixCache:
    """Reuse stored KV chunks of a prompt's prefix for a transformers causal LM.

    Args:
        model: a decoder-only ``PreTrainedModel`` in eval mode.
        backend: where chunks live (any kvbucket ``StorageBackend``: a hybrid stack, a remote tier).
        salt: isolates tenants; chunks stored under one salt are never used under another.
        chunk_tokens: tokens a chunk (256, as LMCache). Every sharer must use the same value.
        model_id: the model's name in keys (default: ``config._name_or_path`` or the model type).
            The model's identity (its whole config and its weights: the files it was loaded from,
            else every parameter's bytes) is always mixed into the hash and the names, so two
            different models sharing a name never share chunks.
        store: write new full chunks (in the background). ``False`` makes the cache read-only.
        max_pending_chunks: store-queue bound; past it new chunks are dropped (counted), never
            delaying generation.
        fetch_window: chunks asked for in one ``batched_get`` while walking the prefix.
        tenant: the tenant whose keys seal these chunks when the backend's tiers encrypt (the
            engine config's ``encryption`` setting, docs/integrity.md). It is written into the
            object names (``@tenant%<tenant>``), so use a tenant id, not a secret salt.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        backend: StorageBackend,
        *,
        salt: str = "",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        model_id: str | None = None,
        store: bool = True,
        max_pending_chunks: int = 4096,
        fetch_window: int = 16,
        tenant: str | None = None,
    ) -> None:
        if tenant is not None and (not isinstance(tenant, str) or not tenant or any(c in tenant for c in "@%/")):  # noqa: E501
            raise ConfigError("tenant must be a non-empty string without '@', '%' or '/'")
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if not isinstance(fetch_window, int) or fetch_window < 1:
            raise ConfigError(f"fetch_window must be a positive int, got {fetch_window!r}")
        if not isinstance(salt, str):
            raise ConfigError(f"salt must be a string, got {type(salt).__name__}")
        if not isinstance(backend, StorageBackend):
            raise ConfigError(f"backend must be a kvbucket StorageBackend, got {type(backend).__name__}")
        self.model = model
        self.backend = backend
        self.salt = salt
        self.tenant = tenant
        self.chunk_tokens = chunk_tokens
        self.store_enabled = store
        self.fetch_window = fetch_window
        self.layout = probe_kv_layout(model, chunk_tokens)
        self.model_name = key_model_name(model, model_id)
        weights = model_weights(model)  # the files it was loaded from, else every parameter's bytes
        fingerprint = model_fingerprint(model, weights)
        self._seed = self._hash_seed(fingerprint)
        self.identity = model_identity(model, self.model_name, fingerprint, self.layout, weights)
        self._key_model = qualify(self.model_name, self.identity.token)  # the model part of every key
        note = getattr(backend, "note_identity", None)  # tiers that keep manifests record this identity's
        if note is not None:
            note(self.identity)
        self.last_stats = PrefillStats()
        self.store_stats = StoreStats()
        self._queue: queue.Queue[_StoreJob | None] = queue.Queue(maxsize=max_pending_chunks)
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---- keys ------------------------------------------------------------------------------
    def _hash_seed(self, fingerprint: bytes) -> bytes:
        h = blake3.blake3(_HASH_VERSION)
        for part in (
            self.model_name.encode(),
            fingerprint,
            self.layout.dtype_name.encode(),
            repr(self.layout.shape).encode(),
            self.salt.encode(),
        ):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def chunk_keys(self, input_ids: Any) -> list[CacheEngineKey]:
        """Keys of the prompt's full chunks, in order (a partial last chunk has no key)."""
        ids = as_token_list(input_ids)
        keys = []
        prev = self._seed
        t = self.chunk_tokens
        for start in range(0, len(ids) - t + 1, t):
            prev = blake3.blake3(prev + np.asarray(ids[start : start + t], dtype="<i8").tobytes()).digest()
            chunk_hash = int.from_bytes(prev[:16], "big")
            configs = {"tenant": self.tenant} if self.tenant else None
            keys.append(CacheEngineKey(self._key_model, 1, 0, chunk_hash, self.layout.dtype_name, configs))
        return keys

    # ---- lookup / load -----------------------------------------------------------------------
    def lookup(self, input_ids: Any) -> int:
        """Tokens of the longest stored prefix of ``input_ids`` (a multiple of ``chunk_tokens``).

        Probes with ``contains`` without reading chunks (``prefill`` fetches directly instead).
        """
        return len(self._lookup_keys(self.chunk_keys(input_ids))) * self.chunk_tokens

    def _lookup_keys(self, keys: Sequence[CacheEngineKey]) -> list[CacheEngineKey]:
        if not keys:
            return []
        batched = getattr(self.backend, "batched_contains", None)
        hits: list[CacheEngineKey] = []
        if callable(batched):
            for key, found in zip(keys, batched(list(keys)), strict=True):
                if not found:
                    break
                hits.append(key)
            return hits
        for key in keys:  # one probe at a time: stop at the first miss
            if not self.backend.contains(key):
                break
            hits.append(key)
        return hits

    def _load(self, keys: Sequence[CacheEngineKey]) -> tuple[torch.Tensor | None, int]:
        """Fetch the longest stored prefix; ``(n_chunks, layers, 2, T, kv_heads, head)`` of it.

        Chunks are fetched with ``batched_get`` in windows of ``fetch_window`` keys (one round
        trip per window instead of a probe per chunk, then a get), and fetching stops at the
        window holding the first miss: at most ``fetch_window - 1`` chunks are read past it.
        A missing or wrong-sized chunk ends the prefix there: a short hit is correct, a
        wrong-sized one would be corrupt.
        """
        lay = self.layout
        usable: list[Any] = []
        for start in range(0, len(keys), self.fetch_window):
            window = list(keys[start : start + self.fetch_window])
            complete = True
            for key, chunk in zip(window, self.backend.batched_get(window), strict=True):
                if chunk is None:
                    complete = False
                    break
                size = byte_len(chunk)
                if size != lay.nbytes:
                    log.warning(
                        "chunk %s has %d bytes, expected %d for layout %s; treating it as a miss",
                        key.to_string(), size, lay.nbytes, lay.shape,
                    )
                    complete = False
                    break
                usable.append(chunk)
            if not complete:
                break
        if not usable:
            return None, 0
        out = torch.empty((len(usable), *lay.shape), dtype=lay.dtype)
        flat = out.view(len(usable), -1).view(torch.uint8).numpy()
        for i, chunk in enumerate(usable):
            flat[i] = as_u8(chunk)
        return out, len(usable) * lay.nbytes

    # ---- prefill / generate -----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: Any, attention_mask: Any = None) -> DynamicCache:
        """Fill a ``DynamicCache`` with the KV of every prompt token but the last.

        Stored chunks are loaded, the rest is computed, and new full chunks are queued for the
        backend. Pass the returned cache and the *same* ``input_ids`` to ``model.generate``: it
        computes only the last token, whose logits then pick the first new token.
        """
        if self._closed:
            raise KVBucketError("this KVBucketPrefixCache is closed; create a new one")
        ids = as_batch1(input_ids, self.model)
        check_mask(attention_mask, ids.shape[1])
        if self.model.training:
            raise UnsupportedModelError(
                "the model is in training mode (dropout changes the KV); call model.eval() first"
            )
        n = ids.shape[1]
        stats = PrefillStats(prompt_tokens=n)
        t0 = time.perf_counter()
        keys = self.chunk_keys(ids[0])
        t1 = time.perf_counter()
        loaded, nbytes = self._load(keys)
        hit_chunks = 0 if loaded is None else loaded.shape[0]
        hit = hit_chunks * self.chunk_tokens
        cache = self._cache_from_chunks(loaded)
        del loaded
        t2 = time.perf_counter()
        if hit < n:
            out = self.model(
                input_ids=ids[:, hit:],
                past_key_values=cache,
                use_cache=True,
                **logits_to_keep_kwarg(self.model),
            )
            cache = out.past_key_values
        check_cache_shape(cache, self.layout, n)
        t3 = time.perf_counter()
        if self.store_enabled and len(keys) > hit_chunks:
            stats.chunks_queued = self._enqueue(cache, keys, hit_chunks)
        cache.crop(-1)  # generate() recomputes the last token to get its logits
        stats.hit_tokens, stats.computed_tokens, stats.hit_chunks = hit, n - hit, hit_chunks
        stats.bytes_loaded = nbytes
        stats.lookup_seconds, stats.load_seconds, stats.compute_seconds = t1 - t0, t2 - t1, t3 - t2
        self.last_stats = stats
        metrics.PREFIX_TOKENS.labels("hit").inc(hit)
        metrics.PREFIX_TOKENS.labels("computed").inc(n - hit)
        metrics.PREFIX_CHUNKS.labels("loaded").inc(hit_chunks)
        metrics.PREFIX_SECONDS.labels("lookup").observe(t1 - t0)
        metrics.PREFIX_SECONDS.labels("load").observe(t2 - t1)
        metrics.PREFIX_SECONDS.labels("compute").observe(t3 - t2)
        return cache

    def generate(self, input_ids: Any, attention_mask: Any = None, **generate_kwargs: Any) -> Any:
        """``model.generate`` with the prompt's prefix served from the cache. Same return value."""
        if "past_key_values" in generate_kwargs:
            raise ConfigError("KVBucketPrefixCache.generate builds past_key_values itself; do not pass one")
        ids = as_batch1(input_ids, self.model)
        past = self.prefill(ids, attention_mask)
        mask = torch.ones_like(ids)
        return self.model.generate(ids, attention_mask=mask, past_key_values=past, **generate_kwargs)

    def _cache_from_chunks(self, loaded: torch.Tensor | None) -> DynamicCache:
        if loaded is None:
            return new_dynamic_cache(self.model)
        lay = self.layout
        n_tok = loaded.shape[0] * lay.chunk_tokens
        device = self.model.device
        per_layer = []
        for layer in range(lay.layers):
            # (chunks, T, kv_heads, head) -> (1, kv_heads, chunks*T, head), as DynamicLayer holds it
            kv = []
            for which in (0, 1):
                t = loaded[:, layer, which].reshape(n_tok, lay.kv_heads, lay.head_size)
                kv.append(t.permute(1, 0, 2).unsqueeze(0).contiguous().to(device))
            per_layer.append((kv[0], kv[1]))
        cache = new_dynamic_cache(self.model)
        for layer, (k, v) in enumerate(per_layer):
            cache.layers[layer].update(k, v)
        return cache

    # ---- background stores ------------------------------------------------------------------
    def _enqueue(self, cache: DynamicCache, keys: Sequence[CacheEngineKey], first: int) -> int:
        # DynamicLayer grows by torch.cat and never writes in place, so holding these tensors is a
        # consistent snapshot even while generate() keeps extending the cache.
        tensors: list[tuple[Any, Any]] = [(layer.keys, layer.values) for layer in cache.layers]
        if all(k.device.type == "cpu" for k, _ in tensors):
            # The worker packs with numpy: torch ops on a second thread start a second OpenMP team
            # whose spinning threads slow the caller's next forward pass (measured: +19% TTFT).
            tensors = [(np_view(k), np_view(v)) for k, v in tensors]
        queued = 0
        for i in range(first, len(keys)):
            job = _StoreJob(keys[i], tensors, i * self.chunk_tokens)
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                dropped = len(keys) - i
                self.store_stats.dropped += dropped
                metrics.PREFIX_CHUNKS.labels("dropped").inc(dropped)
                log.warning("store queue full; %d new chunk(s) not stored", dropped)
                break
            queued += 1
        self.store_stats.queued += queued
        if queued:
            self._ensure_worker()
        return queued

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._closed:
                raise KVBucketError("this KVBucketPrefixCache is closed")
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._run_worker, name="kvbucket-prefix-store", daemon=True
                )
                self._worker.start()

    def _run_worker(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                batch = [job]
                while len(batch) < 16:  # batch what is already waiting: one round trip for many chunks
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._queue.task_done()
                        self._queue.put(None)  # keep the stop marker for the outer loop
                        break
                    batch.append(nxt)
                self._store_batch(batch)
                for _ in batch[1:]:
                    self._queue.task_done()
            finally:
                self._queue.task_done()

    def _store_batch(self, jobs: list[_StoreJob]) -> None:
        try:
            items = [(job.key, self._pack(job)) for job in jobs]
            stored = self.backend.batched_put(items, blocking=True)
        except Exception as e:
            log.warning("storing %d KV chunk(s) failed: %s", len(jobs), type(e).__name__)
            stored = 0
            items = []
        failed = len(jobs) - stored
        self.store_stats.stored += stored
        self.store_stats.failed += failed
        if stored == len(jobs):
            self.store_stats.bytes_stored += stored * self.layout.nbytes
        metrics.PREFIX_CHUNKS.labels("stored").inc(stored)
        if failed:
            metrics.PREFIX_CHUNKS.labels("store_failed").inc(failed)

    def _pack(self, job: _StoreJob) -> np.ndarray:
        """One chunk in LMCache order, ``(layers, 2, T, kv_heads, head)``, as flat bytes."""
        lay = self.layout
        s, e = job.start, job.start + lay.chunk_tokens
        k0 = job.tensors[0][0]
        if isinstance(k0, np.ndarray):
            out = np.empty(lay.shape, dtype=k0.dtype)
            for layer, (k, v) in enumerate(job.tensors):
                out[layer, 0] = k[0, :, s:e, :].transpose(1, 0, 2)
                out[layer, 1] = v[0, :, s:e, :].transpose(1, 0, 2)
            return out.reshape(-1).view(np.uint8)
        t = torch.empty(lay.shape, dtype=lay.dtype)  # device tensors: copy to host here, off the caller
        for layer, (k, v) in enumerate(job.tensors):
            t[layer, 0].copy_(k[0, :, s:e, :].transpose(0, 1))
            t[layer, 1].copy_(v[0, :, s:e, :].transpose(0, 1))
        return t.view(-1).view(torch.uint8).numpy()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk was stored or failed. False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float | None = DEFAULT_CLOSE_DRAIN_SECS) -> None:
        """Let pending stores land, at most ``timeout`` seconds (None: no bound), then stop the
        worker. Chunks still queued then are dropped (counted in ``store_stats.dropped``, logged);
        a batch being stored goes on in the (daemon) worker and never holds up the process. The
        backend stays open (it is the caller's)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
        if worker is None or not worker.is_alive():
            return
        landed = self.flush(timeout)
        if not landed:
            dropped = 0
            while True:  # what the worker has not taken yet: never stored
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queue.task_done()
                dropped += job is not None
            self.store_stats.dropped += dropped
            metrics.PREFIX_CHUNKS.labels("dropped").inc(dropped)
            log.warning("closing the prefix cache: stores did not finish within %gs; %d queued chunk(s) "
                        "dropped, a batch in progress is left to its store deadline", timeout, dropped)
        self._queue.put(None)  # room: nothing is queued any more
        if landed:
            worker.join(DEFAULT_CLOSE_TIMEOUT_SECS)  # idle: it takes the stop marker at once

    def __enter__(self) -> KVBucketPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KVBucketPrefixCache(model={self.model_name!r}, dtype={self.layout.dtype_name}, "
            f"chunk_tokens={self.chunk_tokens}, backend={self.backend!r})"
        )


@dataclass(frozen=True)
class _StoreJob:
    key: CacheEngineKey
    tensors: list[tuple[Any, Any]]  # per layer (keys, values): numpy views of CPU tensors, else tensors
    start: int


__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "KVBucketPrefixCache",
    "KVChunkLayout",
    "PrefillStats",
    "StoreStats",
    "UnsupportedModelError",
    "model_fingerprint",
    "probe_kv_layout",
]
