"""The model identity of an engine tier (vLLM's secondary tier, SGLang's HiCache backend).

Each engine resolves its model once at start; the tier reads what the engine resolved, and
never downloads anything (:mod:`kvbucket.identity`):

1. ``model_identity`` in the tier's settings, when set to anything but ``"auto"``/``"off"``: a
   token (as ``kvbucket du`` shows), a path to the model (absolute, ``./``, ``~``: its
   identity, or an error at start when it cannot be computed), or text naming the weights.
   ``"off"``: names carry no identity (as before identities; a warning says so);
2. the engine's own model config, when the engine hands one (SGLang's ``ModelConfig``; vLLM hands
   none: :mod:`kvbucket.integrations.vllm_identity`): its HF config (``_commit_hash``, the fields
   that shape attention), revision, quantization and dtype;
3. the model's files: a local directory (a Hub snapshot gives its commit, any other directory
   its weight files' fingerprint), or a Hub repo id found in the local Hub cache
   (``refs/<revision>`` -> ``snapshots/<commit>``), with its ``config.json``.

When none of these says anything about the weights, the tier warns once and names chunks by the
model's name only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from kvbucket.identity.core import (
    ModelIdentity,
    config_fields,
    identity_of_dir,
    is_path_setting,
    setting_path,
    warn_name_only,
)
from kvbucket.identity.files import NoWeightsError
from kvbucket.identity.weights import hub_commit, weights_identity

log = logging.getLogger("kvbucket.identity")


class IdentitySettings(BaseModel):
    """The identity keys of every engine tier."""

    model_identity: str = Field("auto", description="auto (from the engine and the model's files), off "
                                "(names by model name only), or a token / absolute model path / text")
    revision: str | None = Field(None, description="the Hub revision the engine loaded, when not the "
                                 "default branch and the engine does not hand it over")


def hub_cache_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local Hub cache's snapshot of ``repo_id`` at ``revision`` (a branch, tag or commit;
    default ``main``), without a request; None when it is not cached."""
    if repo_id.count("/") != 1 or os.path.isabs(repo_id):
        return None
    from huggingface_hub import constants

    cache = Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else None
    if commit is None:
        ref = repo / "refs" / rev
        commit = ref.read_text().strip() if ref.is_file() else None
    snap = repo / "snapshots" / commit if commit else None
    return snap if snap is not None and snap.is_dir() else None


def engine_config_on_stack(attr: str, names: tuple[str, ...], depth: int = 40) -> Any:
    """An engine's config object held by a caller's frame (a local named one of ``names`` with
    ``attr``), or None. vLLM builds a secondary tier inside its scheduler's connector, whose
    frames hold the ``VllmConfig`` but do not pass it to the tier: only launch-time extras are
    read this way, never the identity itself (:mod:`kvbucket.integrations.vllm_identity`)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        for n in names:
            value = frame.f_locals.get(n)
            if value is not None and hasattr(value, attr):
                return value
        frame = frame.f_back
    return None


def from_model_config(name: str, model_config: Any, kv: dict[str, Any]) -> ModelIdentity:
    """From an engine's resolved model config (vLLM's or SGLang's ``ModelConfig``)."""
    hf = getattr(model_config, "hf_config", None) or getattr(model_config, "hf_text_config", None)
    path = getattr(model_config, "model", None) or getattr(model_config, "model_path", None)
    revision = getattr(model_config, "revision", None)
    commit = hub_commit(config=getattr(model_config, "hf_config", None))
    weights = f"hub:{commit}" if commit else ""
    if not weights and isinstance(path, str):
        snap = path if os.path.isdir(path) else hub_cache_snapshot(path, revision)
        weights = weights_identity(snap, revision=revision) if snap else (f"revision:{revision}" if revision
                                                                         else "")
    fields = config_fields(hf)
    for attr in ("quantization", "dtype", "max_model_len", "context_len"):
        value = getattr(model_config, attr, None)
        if value is not None:
            fields[f"engine_{attr}"] = str(value).removeprefix("torch.")
    fields.update(kv)
    return ModelIdentity(name, weights, fields)


def from_files(name: str, revision: str | None, kv: dict[str, Any]) -> ModelIdentity | None:
    """From the model's files: a local directory, or a Hub repo id in the local Hub cache."""
    where = Path(name) if os.path.isdir(name) else hub_cache_snapshot(name, revision)
    if where is None:
        return None
    try:
        return identity_of_dir(where, name, kv=kv)
    except NoWeightsError as e:
        log.warning("model %r: %s", name, e)
        return None


def resolve(where: str, name: str, settings: IdentitySettings, kv: dict[str, Any],
            model_config: Any = None, key: str = "model_identity") -> ModelIdentity | None:
    """The tier's identity (see the module docstring); None: chunks are named by model name only.
    ``key``: the setting a warning names, spelled where the user sets it."""
    setting = settings.model_identity
    if setting == "off":
        warn_name_only(where, key)
        return None
    if setting != "auto":
        if is_path_setting(setting):  # a path is always the model there (an error if it cannot be)
            found = identity_of_dir(setting_path(setting), name, kv=kv)
            return ModelIdentity(name, found.weights, found.fields)
        return ModelIdentity.from_setting(name, setting)
    ident = from_model_config(name, model_config, kv) if model_config is not None else None
    if ident is None or not ident.weights:
        ident = from_files(name, settings.revision, kv) or ident
    if ident is None or not ident.weights:
        log.warning("%s: cannot tell which weights model %r has (not a local directory, not in the "
                    "local Hub cache); set %s", where, name, key)
        warn_name_only(where, key)
        return None
    log.info("%s: model identity %s (%s)", where, ident.token, json.dumps(ident.weights))
    return ident


__all__ = ["IdentitySettings", "engine_config_on_stack", "from_files", "from_model_config",
           "hub_cache_snapshot", "resolve"]
