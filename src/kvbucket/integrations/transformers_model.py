"""What kvbucket's transformers integration needs to know about a model and its KV cache.

Which models prefix reuse can serve (full-attention ``DynamicLayer`` caches only), the layout of
one stored chunk, the model's identity for chunk keys (its whole config and its weights: the
files it was loaded from, else every parameter's bytes), and the small tensor/cache helpers the
prefix cache uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from kvbucket.errors import ConfigError, KVBucketError
from kvbucket.identity.core import ModelIdentity, config_fields
from kvbucket.identity.digest import hash_buffers
from kvbucket.identity.weights import files_fingerprint, hub_commit

try:
    import torch
    from transformers.cache_utils import DynamicLayer

    from transformers import DynamicCache
except ImportError as e:  # pragma: no cover - depends on installed extras
    raise ImportError(
        "kvbucket.integrations.transformers needs torch and transformers: "
        "pip install 'kvbucket[transformers]'"
    ) from e

DEFAULT_CHUNK_TOKENS = 256


class UnsupportedModelError(KVBucketError, ValueError):
    """The model (or the request) uses a cache shape prefix reuse cannot serve correctly."""


@dataclass(frozen=True)
class KVChunkLayout:
    """Shape of one stored chunk: ``(layers, 2, chunk_tokens, kv_heads, head_size)`` of ``dtype``."""

    layers: int
    kv_heads: int
    head_size: int
    chunk_tokens: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.chunk_tokens, self.kv_heads, self.head_size)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.kv_heads * self.head_size * self.dtype.itemsize

    def token_bytes(self) -> int:
        return self.nbytes // self.chunk_tokens

    def to_kv_layout(self) -> Any:
        """The same layout as :class:`kvbucket.chunks.KVLayout`, which the backend tiers take."""
        from kvbucket.chunks import KVLayout

        return KVLayout(self.layers, self.kv_heads, self.head_size, self.dtype_name, self.chunk_tokens)


# ---- model inspection ----------------------------------------------------------------------


def _text_config(model: Any) -> Any:
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _check_model_config(model: Any) -> None:
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers generative model (no config / generate())"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; prefix KV reuse supports decoder-only LMs"
        )
    text = _text_config(model)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedModelError(
                f"{type(model).__name__} has {', '.join(other)} layers; prefix KV reuse supports only "
                "full-attention caches (a sliding-window or recurrent layer's cache is not a prefix)"
            )
    if (
        not layer_types
        and getattr(text, "sliding_window", None) is not None
        and getattr(text, "use_sliding_window", True)
    ):
        raise UnsupportedModelError(
            f"{type(model).__name__} uses sliding-window attention (sliding_window={text.sliding_window}); "
            "its cache keeps only the last window of tokens, so it cannot be rebuilt from prefix chunks"
        )


def probe_kv_layout(model: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> KVChunkLayout:
    """The chunk layout of ``model``'s KV cache; raises :class:`UnsupportedModelError` for caches
    prefix reuse cannot serve. Call it to size backend tiers before building the prefix cache.
    """
    _check_model_config(model)
    return _probe_layout(model, chunk_tokens)


@torch.inference_mode()
def _probe_layout(model: Any, chunk_tokens: int) -> KVChunkLayout:
    """Learn the KV layout from a one-token forward: exact for any model, whatever its config holds."""
    device = getattr(model, "device", torch.device("cpu"))
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    cache = getattr(out, "past_key_values", None)
    if not isinstance(cache, DynamicCache):
        raise UnsupportedModelError(
            f"{type(model).__name__} returned a {type(cache).__name__} cache; "
            "prefix reuse needs a DynamicCache"
        )
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if kinds:
        raise UnsupportedModelError(
            f"{type(model).__name__} uses {', '.join(kinds)} cache layers; prefix KV reuse supports only "
            "full-attention DynamicLayer caches"
        )
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers}
    dtypes = {layer.keys.dtype for layer in cache.layers} | {layer.values.dtype for layer in cache.layers}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers with different KV shapes or dtypes; "
            "one chunk layout cannot hold them"
        )
    (kshape, vshape), dtype = shapes.pop(), dtypes.pop()
    if kshape != vshape or len(kshape) != 4 or kshape[0] != 1 or kshape[2] != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps keys {kshape} / values {vshape}; "
            "expected (1, kv_heads, 1, head_size) for both after one token"
        )
    return KVChunkLayout(len(cache.layers), kshape[1], kshape[3], chunk_tokens, dtype)


def key_model_name(model: Any, model_id: str | None) -> str:
    name = model_id or getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "")
    name = str(name or type(model).__name__).strip()
    if "@" in name or "\x00" in name:
        raise ConfigError(f"model_id {name!r} must not contain '@' or NUL (they separate key fields)")
    return name


def _tensor_bytes(tensor: Any) -> Any:
    """Every byte of a tensor, on the CPU (bf16 and fp8 have no numpy dtype: seen as uint8)."""
    flat = tensor.detach().reshape(-1).contiguous()
    try:
        return flat.view(torch.uint8).cpu().numpy()
    except (RuntimeError, TypeError):  # a tensor subclass that cannot be viewed as bytes
        return flat.cpu().numpy().tobytes()


def model_weights(model: Any) -> str:
    """The weights part of the model's identity (:mod:`kvbucket.identity.weights`): the Hub
    commit it was loaded from (``config._commit_hash``, or a Hub-cache snapshot path), else the
    digest of every weight file of the local directory it was loaded from (``_name_or_path``;
    kept per machine, so a restart reads no weight byte), else ``tensors:<digest>`` of every
    parameter's and buffer's bytes. A model changed in memory after loading from files (a LoRA
    merged in memory) keeps its files' identity: give it its own ``model_id``."""
    path = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    commit = hub_commit(path if isinstance(path, str) and os.path.isdir(path) else None, model.config)
    if commit:
        return f"hub:{commit}"
    if isinstance(path, str) and os.path.isdir(path):
        found = files_fingerprint(path)
        if found:
            return found
    with torch.no_grad():
        params = sorted(model.state_dict().items())
        return "tensors:" + hash_buffers((name, _tensor_bytes(t)) for name, t in params)


def model_fingerprint(model: Any, weights: str | None = None) -> bytes:
    """A digest of the model's weights (:func:`model_weights`) and its whole config (minus the
    keys that cannot change the KV, :func:`kvbucket.identity.core.config_fields`): the key hash's
    seed, so two models that share a name never share chunks."""
    weights = model_weights(model) if weights is None else weights
    text = json.dumps({"weights": weights, "fields": config_fields(model.config)}, sort_keys=True,
                      default=str)
    return blake3.blake3(text.encode()).digest()


def model_identity(model: Any, name: str, fingerprint: bytes, layout: KVChunkLayout,
                   weights: str | None = None) -> ModelIdentity:
    """The model's identity in chunk names (:mod:`kvbucket.identity`): its weights
    (:func:`model_weights`), its whole config and the KV layout. ``fingerprint`` is not needed
    (kept for callers)."""
    fields = config_fields(model.config)
    fields.update(kv_dtype=layout.dtype_name, kv_shape=list(layout.shape))
    return ModelIdentity(name, model_weights(model) if weights is None else weights, fields)


# ---- small helpers -------------------------------------------------------------------------


def new_dynamic_cache(model: Any) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except Exception:
        return DynamicCache()


def logits_to_keep_kwarg(model: Any) -> dict[str, Any]:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def check_cache_shape(cache: Any, layout: KVChunkLayout, n: int) -> None:
    if len(cache.layers) != layout.layers or cache.get_seq_length() != n:
        raise UnsupportedModelError(
            f"after prefill the cache holds {cache.get_seq_length()} tokens in {len(cache.layers)} layers; "
            f"expected {n} in {layout.layers}. This model's cache does not grow like a DynamicCache."
        )


def as_token_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise UnsupportedModelError(
                    f"batch size {input_ids.shape[0]} is not supported; pass one prompt"
                )
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ConfigError(f"input_ids must be 1-D or (1, n), got shape {tuple(input_ids.shape)}")
        return input_ids.tolist()
    ids = list(input_ids)
    if ids and isinstance(ids[0], list | tuple):
        if len(ids) != 1:
            raise UnsupportedModelError(f"batch size {len(ids)} is not supported; pass one prompt")
        ids = list(ids[0])
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
        raise ConfigError("input_ids must be token ids (ints)")
    return [int(t) for t in ids]


def as_batch1(input_ids: Any, model: Any) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.long()
    else:
        ids = torch.tensor(as_token_list(input_ids), dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ConfigError(f"input_ids must be 1-D or (1, n), got shape {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise UnsupportedModelError(
            f"batch size {ids.shape[0]} is not supported; call once per prompt (each has its own prefix)"
        )
    if ids.shape[1] == 0:
        raise ConfigError("input_ids is empty; a prompt needs at least one token")
    return ids.to(model.device)


def check_mask(attention_mask: Any, n: int) -> None:
    if attention_mask is None:
        return
    mask = torch.as_tensor(attention_mask)
    if mask.numel() != n or not bool((mask == 1).all()):
        raise UnsupportedModelError(
            "attention_mask must be all ones for the prompt (padding would shift the prefix); "
            "pass the unpadded prompt instead"
        )


def np_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view with the same bytes (numpy has no bfloat16: viewed as int16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def byte_len(chunk: Any) -> int:
    if isinstance(chunk, torch.Tensor):
        return chunk.numel() * chunk.element_size()
    return memoryview(chunk).nbytes


def as_u8(chunk: Any) -> np.ndarray:
    if isinstance(chunk, torch.Tensor):
        return chunk.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    view = memoryview(chunk)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "KVChunkLayout",
    "UnsupportedModelError",
    "model_fingerprint",
    "model_identity",
    "model_weights",
    "probe_kv_layout",
]
