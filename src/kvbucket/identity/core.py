"""A model's identity: what changes the KV bytes of the same tokens, as one short token.

Two deployments that share a model *name* may not share KV: new weights (another Hub revision,
a fine-tune written over a local path), another ``rope_scaling`` or ``max_position_embeddings``,
another quantization or KV cache dtype all give other bytes for the same tokens. A
:class:`ModelIdentity` holds what decides those bytes:

- ``weights``: ``hub:<commit>`` (a resolved Hub commit hash, free to read), else
  ``files:<digest>`` (:func:`kvbucket.identity.weights.files_fingerprint`: the weight files'
  names, sizes and a sample of their bytes), else ``sampled:<digest>`` (tensors in memory, the
  transformers integration), else ``set:<text>`` (a ``model_identity`` setting);
- ``fields``: the config fields that shape attention and positions (:data:`ATTENTION_FIELDS`),
  the model and KV cache dtypes, quantization, and the layout the engine already names.

Its :attr:`~ModelIdentity.token` (16 hex digits, the same BLAKE2b-64 as the envelope's identity
field, :func:`kvbucket.envelope.identity_digest`) is appended to the model part of every chunk
name (``<model>~<token>``, :func:`qualify`), so chunks of another identity are other objects: a
miss, never a deletion. Names without a token are *name-only* (written before identities, or by
a process that knows none): read only by a process configured to accept them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbucket.envelope import identity_digest
from kvbucket.identity.weights import weights_identity

log = logging.getLogger("kvbucket.identity")

SEP = "~"
TOKEN_LEN = 16
_TOKEN_RE = re.compile(r"^[0-9a-f]{16}$")
_QUALIFIED_RE = re.compile(r"^(.+)~([0-9a-f]{16})$")

#: Config fields that change the KV of the same tokens (attention shape, positions, precision).
ATTENTION_FIELDS: tuple[str, ...] = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "rotary_dim", "rotary_pct", "position_embedding_type", "sliding_window",
    "use_sliding_window", "layer_types", "attention_bias", "qk_layernorm", "use_qk_norm",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "attn_logit_softcapping", "query_pre_attn_scalar", "vocab_size", "quantization_config",
    "torch_dtype", "dtype",
)


def is_token(text: str) -> bool:
    return bool(_TOKEN_RE.match(text))


def token_of(description: str) -> str:
    """The 16-hex token of an identity description (or the token itself, when given one)."""
    return description if is_token(description) else identity_digest(description).hex()


def _plain(value: Any) -> Any:
    """A JSON-stable form of a config value (dicts sorted, objects by their dict or repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return _plain(to_dict())
        except Exception:
            pass
    return str(value).removeprefix("torch.")


def config_fields(config: Any) -> dict[str, Any]:
    """The :data:`ATTENTION_FIELDS` a model config (a ``PretrainedConfig``, a dict) sets.

    A multimodal config's text part counts (``get_text_config``): it is the one that makes KV.
    """
    if config is None:
        return {}
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:
            config = get_text()
    src = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    out: dict[str, Any] = {}
    for name in ATTENTION_FIELDS:
        value = src.get(name) if isinstance(src, dict) else None
        if value is None and not isinstance(config, dict):
            value = getattr(config, name, None)
        if value is not None:
            out[name] = _plain(value)
    return out


@dataclass(frozen=True)
class ModelIdentity:
    """See the module docstring. ``fields`` values must be JSON-able (see :func:`config_fields`)."""

    model: str
    weights: str = ""
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def description(self) -> str:
        """The canonical text the token is the digest of (stable across processes and hosts)."""
        if self.weights.startswith("set:") and not self.fields:
            return self.weights[len("set:"):]
        return json.dumps({"model": self.model, "weights": self.weights, "fields": self.fields},
                          sort_keys=True, separators=(",", ":"), default=str)

    @property
    def token(self) -> str:
        return token_of(self.description())

    def summary(self) -> str:
        """A short human description for logs and manifests (never holds secrets: names, digests)."""
        return f"{self.model} weights={self.weights or 'unknown'} ({len(self.fields)} config fields)"

    def manifest(self) -> dict[str, Any]:
        return {"model": self.model, "token": self.token, "weights": self.weights, "fields": self.fields}

    @classmethod
    def from_setting(cls, model: str, setting: str) -> ModelIdentity:
        """A ``model_identity`` setting: a token (16 hex digits, as ``kvbucket du`` shows) or any
        text that names the deployment (``org/model@<commit>``); its digest is the token."""
        return cls(model, f"set:{setting}")


def identity_of_dir(path: str | os.PathLike[str], model: str | None = None, *,
                    kv: dict[str, Any] | None = None) -> ModelIdentity:
    """The :class:`~kvbucket.identity.core.ModelIdentity` of a local model directory: its
    ``config.json`` fields and its weights (a Hub snapshot's commit, else the files' fingerprint).
    ``kv``: the engine's KV fields (cache dtype, layout) to add. Nothing is downloaded."""
    p = Path(path)
    cfg_file = p / "config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    fields = config_fields(config)
    fields.update(kv or {})
    return ModelIdentity(model or p.name, weights_identity(p, config), fields)


class IdentitySetting:
    """A ``model_identity`` setting: one text (every model this process serves) or a dict of model
    name -> text (``"*"``: the others); None or {} means none: names stay name-only."""

    def __init__(self, setting: str | dict[str, str] | None) -> None:
        if isinstance(setting, str):
            setting = {"*": setting} if setting else {}
        self._by_model = dict(setting or {})
        self._tokens: dict[str, str | None] = {}
        # An absolute path to a model directory: its identity (config.json, weights), read once now.
        self._dirs: dict[str, ModelIdentity] = {}
        for text in self._by_model.values():
            if text and os.path.isabs(text) and os.path.isdir(text):
                self._dirs[text] = identity_of_dir(text)

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def identity(self, model: str) -> ModelIdentity | None:
        text = self._by_model.get(model, self._by_model.get("*"))
        if not text:
            return None
        found = self._dirs.get(text)
        if found is not None:
            return ModelIdentity(model, found.weights, found.fields)
        return ModelIdentity.from_setting(model, text)

    def token(self, model: str) -> str | None:
        try:
            return self._tokens[model]
        except KeyError:
            ident = self.identity(model)
            tok = self._tokens[model] = ident.token if ident is not None else None
            return tok


def qualify(model_field: str, token: str | None) -> str:
    """``<model>~<token>``: the model part of a chunk name with its identity (as is without one)."""
    return f"{model_field}{SEP}{token}" if token else model_field


def split(model_field: str) -> tuple[str, str | None]:
    """``(model, token)`` of a model part of a name; ``token`` None for a name-only one."""
    m = _QUALIFIED_RE.match(model_field)
    return (m.group(1), m.group(2)) if m else (model_field, None)


def qualify_key_string(key: str, token: str | None) -> str:
    """A key string (``model@...``: LMCache's and kvbucket's keys) with the token on its model."""
    if not token:
        return key
    model, sep, rest = key.partition("@")
    return f"{qualify(model, token)}{sep}{rest}"


def split_key_string(key: str) -> tuple[str, str | None]:
    """``(key string without the token, token)``; ``token`` None for a name-only key."""
    model, sep, rest = key.partition("@")
    bare, token = split(model)
    return (f"{bare}{sep}{rest}" if token else key), token


_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_name_only(where: str) -> None:
    """Once per process and place: without an identity, reuse is keyed by the model's name only."""
    with _warn_lock:
        if where in _warned:
            return
        _warned.add(where)
    log.warning(
        "%s: no model identity is known, so KV chunks are shared by model name only: a model "
        "redeployed under the same name with other weights or config would be served the old KV. "
        "Set model_identity (a token from `kvbucket du`, or text naming the weights such as "
        "org/model@<commit>) to key chunks by identity (docs/architecture.md, Model identity)", where)


__all__ = [
    "ATTENTION_FIELDS",
    "SEP",
    "TOKEN_LEN",
    "IdentitySetting",
    "ModelIdentity",
    "config_fields",
    "identity_of_dir",
    "is_token",
    "qualify",
    "qualify_key_string",
    "split",
    "split_key_string",
    "token_of",
    "warn_name_only",
]
