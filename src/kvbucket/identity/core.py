"""A model's identity: what changes the KV bytes of the same tokens, as one short token.

Two deployments that share a model *name* may not share KV: new weights (another Hub revision,
a fine-tune written over a local path), another ``rope_scaling`` or ``max_position_embeddings``,
another quantization or KV cache dtype all give other bytes for the same tokens. A
:class:`ModelIdentity` holds what decides those bytes:

- ``weights``: ``hub:<commit>`` (a resolved Hub commit hash, free to read), else
  ``files:<digest>`` (:func:`kvbucket.identity.weights.files_fingerprint`: every file of the
  model but a short list (:mod:`.files`), its name, size and full content, hashed once per
  machine), else ``tensors:<digest>`` (every parameter's bytes in memory, the transformers
  integration), else ``set:<text>`` (a ``model_identity`` label, never a path);
- ``fields``: the whole model config minus :data:`IGNORED_FIELDS` (:func:`config_fields`),
  the model and KV cache dtypes, quantization, and the layout the engine already names.

While the weights of a local directory are hashed for the first time, its identity is *not
known yet* (:class:`IdentityPending`): a miss, never a guessed name.

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbucket.envelope import identity_digest
from kvbucket.errors import ConfigError
from kvbucket.identity.files import LARGE_FILE, WEIGHT_SUFFIXES, ModelFilesError, NoWeightsError
from kvbucket.identity.weights import RETRY_S, IdentityPending, weights_identity, weights_job

log = logging.getLogger("kvbucket.identity")

SEP = "~"
TOKEN_LEN = 16
_TOKEN_RE = re.compile(r"^[0-9a-f]{16}$")
_QUALIFIED_RE = re.compile(r"^(.+)~([0-9a-f]{16})$")

#: Config keys that cannot change the KV bytes of the same tokens, left out of the identity (at
#: the top and in every nested ``*_config``). Everything else counts, known or not: a field this
#: list does not name changes the identity (a miss), it is never ignored. ``torch_dtype`` is
#: spelt ``dtype`` (transformers renamed it), so either spelling gives one identity; with both,
#: ``dtype`` wins, as in transformers.
IGNORED_FIELDS: frozenset[str] = frozenset({
    # which class loads it, which library wrote it, where from
    "architectures", "transformers_version", "name_or_path", "_name_or_path", "_commit_hash",
    # transformers' runtime choice of kernels (the model's maths is the same)
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal",
    "_experts_implementation",
    # token ids the tokenizer and the generation loop use (the KV is of the token ids given)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # generation settings (sampling happens after the KV is made)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "generation_config",
    # what a forward returns, not what it computes; training and task heads
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_return_dict", "id2label", "label2id", "problem_type", "finetuning_task",
    "task_specific_params", "tokenizer_class", "prefix", "initializer_range",
})


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


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        try:
            out = to_dict()
            if isinstance(out, dict):
                return out
        except Exception:
            pass
    return dict(getattr(config, "__dict__", {}))


def _kept(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        key = str(key)
        if key in IGNORED_FIELDS or value is None:
            continue
        if key.endswith("_config") and not isinstance(value, dict) and hasattr(value, "to_dict"):
            value = _config_dict(value)
        if key.endswith("_config") and isinstance(value, dict) and key != "quantization_config":
            value = _kept(value)  # a nested model config (text_config, vision_config, ...)
        if key == "torch_dtype":
            if config.get("dtype") is not None:
                continue  # both spelt: transformers keeps ``dtype`` (PretrainedConfig.__post_init__)
            key = "dtype"
        out[key] = _plain(value)
    return dict(sorted(out.items()))


def config_fields(config: Any) -> dict[str, Any]:
    """The whole model config (a ``PretrainedConfig``, an engine's resolved config, a dict from
    ``config.json``) minus :data:`IGNORED_FIELDS`, nested configs included, JSON-able."""
    if config is None:
        return {}
    return _kept(_config_dict(config))


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


def is_path_setting(text: str) -> bool:
    """Whether a ``model_identity`` text names a path (absolute, ``./``, ``../``, ``~``): it is then
    the model at that path, never text (see :class:`IdentitySetting`)."""
    return os.path.isabs(text) or text.startswith(("./", "../", "~")) or text in (".", "..")


def setting_path(text: str) -> Path:
    """The absolute path a path setting names (``~`` expanded, relative to the working directory)."""
    return Path(os.path.abspath(os.path.expanduser(text)))


def identity_of_dir(path: str | os.PathLike[str], model: str | None = None, *,
                    kv: dict[str, Any] | None = None, wait: bool = True) -> ModelIdentity:
    """The :class:`~kvbucket.identity.core.ModelIdentity` of a local model directory: its whole
    ``config.json`` (:func:`config_fields`) and its weights (a real Hub snapshot's commit, else the
    digest of every file that counts, :mod:`kvbucket.identity.weights`). ``path`` may be one
    weights file (a GGUF): its digest, with the ``config.json`` beside it if any. ``kv``: the
    engine's KV fields (cache dtype, layout) to add. Nothing is downloaded.

    Raises :class:`~kvbucket.identity.files.ModelFilesError` when ``path`` does not exist, holds no
    weight file, or an entry under it cannot be read (never an identity of what could be seen).
    The first computation on a machine reads every byte; later ones cost a ``stat`` per file.
    ``wait=False``: raises :class:`IdentityPending` instead of waiting for the first computation
    (which then runs in a background thread): call again later."""
    p = Path(path)
    if not p.exists():
        raise ModelFilesError(f"the model path {p} does not exist (not mounted or downloaded yet?): "
                              "its identity is not known until it does")
    cfg_file = (p.parent if p.is_file() else p) / "config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    fields = config_fields(config)
    fields.update(kv or {})
    weights = weights_identity(p, wait=wait)
    if not weights:
        raise NoWeightsError(f"no weight file under {p} (none of {', '.join(WEIGHT_SUFFIXES[:4])}, ..., "
                             f"nor any file of {LARGE_FILE >> 20} MiB or more): point model_identity at the "
                             "directory the engine loads its weights from")
    return ModelIdentity(model or p.name, weights, fields)


class IdentitySetting:
    """A ``model_identity`` setting: one text (every model this process serves) or a dict of model
    name -> text (``"*"``: the others); None or {} means none: names stay name-only.

    A text that names a path (absolute, ``./``, ``../``, ``~``: :func:`is_path_setting`) is the
    identity of the model there (:func:`identity_of_dir`: a directory, or one weights file),
    computed in the background the first time on a machine; any other text is a label (its
    digest is the token). Until a path's identity is known (being hashed, or the path missing,
    holding no weights or unreadable: logged with the path, tried again every :data:`RETRY_S`
    seconds), :meth:`identity` and :meth:`token` raise :class:`IdentityPending` (never a guessed
    identity, never ``None``, which means name-only, never the path as text): callers answer
    lookups as misses and drop (and count) stores. :meth:`ready` says whether it is known;
    :meth:`wait` waits for it (and raises when it cannot be computed)."""

    def __init__(self, setting: str | dict[str, str] | None) -> None:
        if isinstance(setting, str):
            setting = {"*": setting} if setting else {}
        self._by_model = dict(setting or {})
        self._tokens: dict[str, str | None] = {}
        # An absolute path to a model directory: its identity (config.json, weights), once known.
        self._dirs: dict[str, ModelIdentity] = {}
        self._pending: dict[str, tuple[Any, float]] = {}  # text -> (its WeightsJob, next retry)
        self._errors: dict[str, Exception] = {}  # text -> why its last computation failed
        self._lock = threading.Lock()
        self.pending_misses = 0  # keys answered as misses while an identity was not known yet
        self.pending_refused = 0  # names refused (stores dropped) while it was not known yet
        for text in self._by_model.values():
            if text and is_path_setting(text) and text not in self._dirs:
                self._resolve(text)

    def _resolve(self, text: str) -> ModelIdentity | None:
        """The directory's identity when known; else starts (or checks) its computation."""
        try:
            found = self._dirs[text] = identity_of_dir(setting_path(text), wait=False)
            self._pending.pop(text, None)
            self._errors.pop(text, None)
            return found
        except IdentityPending:
            if text not in self._pending or text in self._errors:
                log.info("model identity of %s: hashing its weight files (once per machine); until "
                         "done, its chunks are misses and nothing is stored", text)
            self._pending[text] = (weights_job(setting_path(text)), 0.0)
            self._errors.pop(text, None)
        except Exception as e:  # missing, no weights, unreadable: still unknown, tried again later
            if text not in self._errors:
                log.error("model identity of %s cannot be computed (%s); its chunks are misses and nothing "
                          "is stored until it can (retried every %.0f s; or set model_identity to a "
                          "label such as v3)", text, e, RETRY_S)
            self._pending[text] = (None, time.monotonic() + RETRY_S)
            self._errors[text] = e
        return None

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def _text(self, model: str) -> str | None:
        return self._by_model.get(model, self._by_model.get("*")) or None

    def _known(self, text: str) -> ModelIdentity | None:
        found = self._dirs.get(text)
        if found is not None or text not in self._pending:
            return found
        with self._lock:
            job, retry_at = self._pending.get(text, (None, 0.0))
            if text in self._dirs:
                return self._dirs[text]
            if (job is not None and job.done()) or (job is None and time.monotonic() >= retry_at):
                return self._resolve(text)
        return None

    def ready(self, model: str | None = None) -> bool:
        """Whether ``model``'s identity (every model's, when None) is known (no hashing under way)."""
        texts = [self._text(model)] if model is not None else list(self._by_model.values())
        return all(t not in self._pending or self._known(t) is not None for t in texts if t)

    def unknown(self, n: int = 0) -> bool:
        """Whether an identity is set but not known yet; if so, ``n`` keys are counted as misses
        (a request path's check: one dict lookup once every identity is known)."""
        if not self._pending or self.ready():
            return False
        self.pending_misses += n
        return True

    def pending_counts(self) -> dict[str, int]:
        return {"misses": self.pending_misses, "refused": self.pending_refused}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every identity is known (or ``timeout`` seconds); whether they are. A
        computation that failed (a weight file unreadable) raises :class:`ConfigError` saying so
        (it is tried again every :data:`RETRY_S` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready():
            failed = [(t, e) for t, e in list(self._errors.items()) if t in self._pending]
            if failed:
                text, err = failed[0]
                raise ConfigError(f"the model identity of {text} cannot be computed: {err} (or set "
                                  "model_identity to a token or a label such as v3)") from err
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            jobs = [j for j, _ in list(self._pending.values()) if j is not None]
            if jobs:
                jobs[0].wait(left)
            else:
                time.sleep(0.05)
        return True

    def identity(self, model: str) -> ModelIdentity | None:
        """``model``'s identity; None: name-only; :class:`IdentityPending`: not known yet."""
        text = self._text(model)
        if not text:
            return None
        if text in self._pending:
            found = self._known(text)
            if found is None:
                self.pending_refused += 1
                raise IdentityPending(text, self._errors.get(text))
        found = self._dirs.get(text)
        if found is not None:
            return ModelIdentity(model, found.weights, found.fields)
        return ModelIdentity.from_setting(model, text)

    def token(self, model: str) -> str | None:
        """``model``'s token; None: name-only; :class:`IdentityPending`: not known yet."""
        try:
            return self._tokens[model]
        except KeyError:
            ident = self.identity(model)  # raises IdentityPending: nothing remembered
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


def warn_name_only(where: str, key: str = "model_identity", accept: str | None = None) -> None:
    """Once per process and place: without an identity, reuse is keyed by the model's name only.

    ``key``: the setting that gives this path an identity, spelled where the user sets it;
    ``accept``: the setting that keeps reading name-only chunks once it is set (None: that path
    has none, so they become misses for good)."""
    with _warn_lock:
        if where in _warned:
            return
        _warned.add(where)
    after = (f"until {accept} is also set" if accept else
             "for good (`kvbucket rm URL --model NAME --identity none` removes them)")
    log.warning(
        "%s: no model identity is known, so KV chunks are shared by model name only: a model "
        "redeployed under the same name with other weights or config would be served the old KV. "
        "Set %s (an absolute path to the model directory, a token from `kvbucket du`, or text naming "
        "the weights such as org/model@<commit>) to key chunks by identity; once it is set, the chunks "
        "stored so far by name only are misses %s", where, key, after)


__all__ = [
    "IGNORED_FIELDS",
    "SEP",
    "TOKEN_LEN",
    "IdentityPending",
    "IdentitySetting",
    "ModelIdentity",
    "config_fields",
    "identity_of_dir",
    "is_path_setting",
    "is_token",
    "qualify",
    "qualify_key_string",
    "setting_path",
    "split",
    "split_key_string",
    "token_of",
    "warn_name_only",
]
