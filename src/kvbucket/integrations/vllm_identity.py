"""The model identity of kvbucket's vLLM tier, from what vLLM hands a secondary tier.

vLLM 0.33 hands an offloading spec only an ``OffloadingConfig``; of the model it holds
``OffloadingModelConfig``: the name vLLM loaded (a local directory or a Hub repo id), the KV cache
dtype and the longest request. Its scheduler side does not run inside ``set_current_vllm_config``,
so there is no supported route to the whole ``VllmConfig`` there. The identity is taken from what
is handed over: the model's files (a local directory, or the repo's snapshot in the local Hub
cache: :func:`kvbucket.integrations.engine_identity.from_files`) plus the KV dtype and length.

What vLLM decides at launch and the files do not say (``--quantization`` applied on load,
``--revision`` of a repo id) comes from the tier's own ``quantization``/``revision`` settings,
else from the ``VllmConfig`` held by the scheduler's frames (:data:`CONFIG_LOCALS`, the
``ModelConfig`` fields :data:`LAUNCH_FIELDS`): an extra, read once at start, that logs when it
is not found. tests/engines/vllm_checks.py pins these names against vLLM's own classes, so an
upgrade that renames them fails there, loudly, rather than here, quietly.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbucket.identity.core import ModelIdentity
from kvbucket.integrations.engine_identity import IdentitySettings, engine_config_on_stack, resolve

log = logging.getLogger("kvbucket.identity")

WHERE = "kvbucket vLLM tier"
#: The setting the name-only warning names (the tier's entry in vLLM's kv_connector_extra_config).
SETTING = "model_identity in the kvbucket entry of secondary_tiers"
#: The locals of vLLM's frames that hold its ``VllmConfig`` when it builds a secondary tier
#: (``OffloadingConnector.__init__`` and ``OffloadingConnectorScheduler.__init__`` in vLLM 0.33).
CONFIG_LOCALS = ("vllm_config",)
#: ``VllmConfig.model_config`` fields that change the KV and that the model's files do not say.
LAUNCH_FIELDS = ("quantization", "revision")


def launch_extras() -> dict[str, Any] | None:
    """:data:`LAUNCH_FIELDS` of the ``VllmConfig`` on the caller's stack, or None when not found."""
    engine = engine_config_on_stack("model_config", CONFIG_LOCALS)
    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        return None
    return {f: getattr(model_config, f, None) for f in LAUNCH_FIELDS}


def tier_identity(model: Any, settings: IdentitySettings,
                  quantization: str | None = None) -> ModelIdentity | None:
    """The tier's identity from vLLM's ``OffloadingModelConfig`` (``model``) and the settings;
    None: chunks are named by the model's name only (a warning says which key to set)."""
    stated = {"quantization": quantization, "revision": settings.revision}
    found = launch_extras() if settings.model_identity == "auto" else {}
    if found is None:
        found = {}
        if not all(stated.values()):
            log.warning(
                "%s: vLLM's launch settings (--quantization, --revision) were not found where vLLM 0.33 "
                "keeps them (a local %s of the scheduler's frames): the identity of %r comes from its "
                "files and KV dtype only. If vLLM runs with --quantization or --revision, set "
                "\"quantization\"/\"revision\" in the tier's entry",
                WHERE, " or ".join(CONFIG_LOCALS), model.name)
    extras = {k: v if v is not None else found.get(k) for k, v in stated.items()}
    kv: dict[str, Any] = {"kv_cache_dtype": model.dtype, "max_model_len": model.max_model_len}
    if extras["quantization"]:
        kv["engine_quantization"] = str(extras["quantization"])
    revision = extras["revision"]
    chosen = settings.model_copy(update={"revision": str(revision)}) if revision else settings
    return resolve(WHERE, model.name, chosen, kv, key=SETTING)


__all__ = ["CONFIG_LOCALS", "LAUNCH_FIELDS", "SETTING", "launch_extras", "tier_identity"]
