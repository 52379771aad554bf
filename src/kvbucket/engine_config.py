"""Typed configuration: the LMCache-style engine config (seeds 001 and 004). Users import it from
:mod:`kvbucket.config`; the backends read it from here, below them.

``EngineConfig`` takes the same keys as LMCache's YAML files, so an LMCache user's file works
as it is. It is loaded from YAML or JSON and overridden by ``KVBUCKET_<KEY>`` environment
variables (``KVBUCKET_CHUNK_SIZE=512``, ``KVBUCKET_EXTRA_CONFIG='{"s3_region": "us-east-1"}'``).
Every mistake is a :class:`ConfigError` naming the key, where it came from, and the fix.

Booleans are lenient the way LMCache's are (``true/false``, ``yes/no``, ``on/off``, ``1/0``, any
case), because LMCache users' YAML files and environment variables spell them that way; any
other value is an error, never silently false.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbucket.did_you_mean import closest, keys_at, unknown_key_hint, value_hint
from kvbucket.encryption import EncryptionConfig
from kvbucket.env_vars import warn_unknown
from kvbucket.errors import ConfigError
from kvbucket.secrets import looks_secret, redact

log = logging.getLogger("kvbucket.config")  # the name users import this from

ENV_PREFIX = "KVBUCKET_"
CONFIG_FILE_ENV = "KVBUCKET_CONFIG_FILE"
GB = 1024**3
# LMCache 0.5.6 engine-config keys that kvbucket's engine config does not take (they configure
# LMCache's GPU connector, P2P/PD transfer, blending, controller...): named in the error so a
# user who points kvbucket at a full LMCache file knows what to remove.
LMCACHE_ONLY_KEYS = frozenset({
    "local_cpu_use_hugepages", "reserve_local_cpu_size", "local_disk_path_sharding", "use_layerwise",
    "save_decode_cache", "pre_caching_hash_algorithm", "enable_blending", "blend_recompute_ratios",
    "blend_thresholds", "blend_check_layers", "blend_min_tokens", "blend_special_str", "retrieve_locations",
    "store_location", "enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "mp_host", "mp_port",
    "enable_controller", "lmcache_instance_id", "controller_pull_url", "controller_reply_url",
    "lmcache_worker_ports", "lmcache_worker_ids", "enable_pd", "pd_role", "pd_buffer_size",
    "pd_buffer_device", "transfer_channel", "nixl_backends", "nixl_buffer_size", "nixl_buffer_device",
    "gds_path", "gds_buffer_size", "use_gds", "external_lookup_client", "py_enable_gc", "cache_policy",
    "numa_mode", "internal_api_server_enabled", "internal_api_server_port_start", "priority_limit",
    "runtime_plugin_locations", "storage_plugins", "lookup_timeout_ms", "min_retrieve_tokens",
    "enable_lazy_memory_allocator", "enable_kv_events", "use_gpu_connector_v3", "remote_config_url",
    "app_id", "enable_chunk_statistics", "enable_hidden_state_cache",
})

#: extra_config keys the engine config itself reads (the stores and plugins check theirs)
_ENGINE_EXTRA_KEYS = ("encryption", "unsealed", "metrics")


#: the spellings of a boolean the engine config accepts where pydantic does not parse it (extra_config)
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False,
               "0": False}

class EngineConfig(BaseModel):
    """The storage-backend stack: local CPU -> local disk -> remote store(s)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    chunk_size: int = Field(256, gt=0, description="tokens per KV chunk")
    local_cpu: bool = Field(True, description="keep a CPU-memory tier")
    max_local_cpu_size: float = Field(5.0, ge=0, description="CPU tier size in GB (GiB, as LMCache)")
    local_disk: str | None = Field(None, description="directory (path or file:// URL) of the disk tier")
    max_local_disk_size: float = Field(0.0, ge=0, description="disk tier size in GB (GiB)")
    remote_url: str | None = Field(None, description="remote store URL: file://, hf://buckets/..., s3://...")
    remote_serde: str = Field("naive", description="how chunks are serialized for remote tiers")
    save_unfull_chunk: bool = Field(False, description="let remote tiers keep partial chunks")
    blocking_timeout_secs: float = Field(10.0, gt=0, description="bound on each blocking remote call")
    enable_async_loading: bool = Field(False, description="overlap remote fetch and decode (pipelined)")
    remote_storage_plugins: list[str] = Field(default_factory=list, description="type[.instance] names")
    extra_config: dict[str, Any] = Field(default_factory=dict, description="store and plugin options")

    # ---- validation --------------------------------------------------------------------------
    @field_validator("local_disk", "remote_url", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() in ("", "none", "null"):
            return None
        return v

    @field_validator("remote_url")
    @classmethod
    def _remote_bucket_id(cls, v: str | None) -> str | None:
        """``ns/name[/prefix]`` is the Hub bucket, as on the command line (one rule:
        :mod:`kvbucket.stores.urls`); text that is also an existing local path is refused."""
        from kvbucket.stores.urls import resolve_configured_url

        return None if v is None else resolve_configured_url(v, "remote_url")

    @field_validator("local_disk")
    @classmethod
    def _disk_path(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if "://" in v and not v.startswith("file://"):
            raise ValueError(f"must be a directory path or a file:// URL, not {v!r}")
        path = v.removeprefix("file://")
        if not path:
            raise ValueError("file:// names no directory; use file:///absolute/dir or a path")
        return str(Path(path).expanduser())

    @field_validator("remote_serde")
    @classmethod
    def _serde_known(cls, v: str) -> str:
        from kvbucket.chunks import get_serde

        get_serde(v)
        return v

    @field_validator("remote_storage_plugins", mode="before")
    @classmethod
    def _plugins_list(cls, v: Any) -> Any:
        if isinstance(v, str):  # a single name, or "a,b" from an env var
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("remote_storage_plugins")
    @classmethod
    def _plugins_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or name.startswith(".") or name.endswith(".") or ".." in name:
                raise ValueError(
                    f"{name!r} is not a plugin name; use 'type' or 'type.instance' (e.g. 'hfbucket.us')"
                )
        dupes = sorted({n for n in v if v.count(n) > 1})
        if dupes:
            raise ValueError(f"lists {', '.join(dupes)} more than once")
        return v

    @field_validator("extra_config", mode="before")
    @classmethod
    def _extra_none(cls, v: Any) -> Any:
        return {} if v is None else v

    @field_validator("extra_config")
    @classmethod
    def _extra_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in v:
            if not isinstance(k, str) or not k:
                raise ValueError(f"keys must be non-empty strings, got {k!r}")
            typo = closest(k, _ENGINE_EXTRA_KEYS, cutoff=0.8) if k not in _ENGINE_EXTRA_KEYS else None
            if typo is not None:  # other keys belong to the stores and plugins, which check them
                raise ValueError(f"unknown key {k!r}: did you mean {typo!r}?")
        enc = v.get("encryption")
        if enc is not None and not isinstance(enc, bool):
            if not isinstance(enc, dict):
                raise ValueError("encryption must be true, false, or {keyring_file: ..., keyring_env: ...}")
            try:
                EncryptionConfig.model_validate(enc)
            except ValidationError as e:
                fields = ", ".join(".".join(map(str, err["loc"])) for err in e.errors())
                hints = "".join(unknown_key_hint(EncryptionConfig, err["loc"]) for err in e.errors()
                                if err["type"] == "extra_forbidden")
                raise ValueError(
                    f"encryption takes enabled, keyring_file and keyring_env; check {fields}"
                    + (f" ({hints.strip()})" if hints else "")
                ) from None
        if "metrics" in v:  # lenient as the engine config's own booleans ("false", 0, off)
            metrics = _BOOL_WORDS.get(str(v["metrics"]).strip().lower()) if not isinstance(
                v["metrics"], dict | list | float) else None
            if metrics is None:
                raise ValueError("metrics must be true or false (false: build_backend counts nothing; "
                                 "yes/no, on/off and 1/0 are accepted too)")
            v = {**v, "metrics": metrics}
        if v.get("unsealed", "miss") not in ("miss", "accept"):
            raise ValueError("unsealed must be 'miss' or 'accept'")
        return v

    @property
    def encryption(self) -> Any:
        """``extra_config.encryption``: AES-256-GCM at rest per tenant (docs/integrity.md).

        Kept in ``extra_config`` because every top-level key is an LMCache key."""
        return self.extra_config.get("encryption")

    @property
    def model_identity(self) -> Any:
        """``extra_config.model_identity``: the remote tiers' model identity (kvbucket.identity):
        a token, text naming the weights, an absolute path to the model directory, or a dict of
        model name -> one of those. Unset: chunks are shared by model name only."""
        return self.extra_config.get("model_identity")

    @property
    def metrics(self) -> bool:
        """``extra_config.metrics`` (default true): ``build_backend`` counts every tier
        (``kvbucket_backend_*``) and remote store (``kvbucket_store_*``) in the default registry."""
        return bool(self.extra_config.get("metrics", True))

    @property
    def unsealed(self) -> str:
        """``extra_config.unsealed``: remote objects without a kvbucket envelope, miss or accept."""
        return str(self.extra_config.get("unsealed", "miss"))

    @model_validator(mode="after")
    def _sizes(self) -> EngineConfig:
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ValueError(
                "local_disk is set but max_local_disk_size is 0 GB; set max_local_disk_size to the disk "
                "tier's size in GB (e.g. 20), or remove local_disk"
            )
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ValueError(
                "local_cpu is true but max_local_cpu_size is 0 GB; set it (e.g. 5) or set local_cpu: false"
            )
        return self

    # ---- display without secrets ---------------------------------------------------------------
    def redacted(self) -> dict[str, Any]:
        """The config as a dict with every secret masked (:func:`kvbucket.secrets.redact`)."""
        return redact(self.model_dump())

    def __repr_args__(self) -> Any:
        yield from self.redacted().items()

    # ---- sizes -----------------------------------------------------------------------------------
    @property
    def local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    # ---- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> EngineConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: the engine config must be a mapping of keys to values, got "
                              f"{type(data).__name__}")
        try:
            return cls.model_validate(dict(data))
        except ValidationError as e:
            raise _config_error(e, source, env=False) from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EngineConfig:
        return cls.from_dict(read_config_file(path), source=str(path))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (or JSON, by ``.json`` suffix) mapping; an empty file is an empty mapping."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                          f"{_parse_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values, not a "
                          f"{type(data).__name__}")
    return data


def _parse_problem(e: Exception) -> str:
    """What is wrong and where, without the parser's quote of the line (it may hold a secret)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}, column {e.colno}"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``KVBUCKET_<KEY>`` variables that name engine config keys, parsed."""
    env = os.environ if env is None else env
    fields = EngineConfig.model_fields
    warn_unknown(env, fields)  # a misspelt variable: once per process, with the closest name
    out: dict[str, Any] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV:
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key not in fields:  # warned once below if kvbucket reads no such variable at all
            continue
        if key == "extra_config" or (key == "remote_storage_plugins" and raw.strip().startswith("[")):
            try:
                out[key] = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{var} must be JSON (e.g. {var}='{{\"s3_region\": \"us-east-1\"}}'): {e}"
                ) from None
        else:
            out[key] = raw
    return out


def load_engine_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """File (``path`` or ``$KVBUCKET_CONFIG_FILE``, optional) < ``KVBUCKET_*`` env < ``overrides``.

    ``KVBUCKET_EXTRA_CONFIG`` is merged key by key into the file's ``extra_config``.
    """
    env = os.environ if env is None else env
    path = path if path is not None else env.get(CONFIG_FILE_ENV) or None
    data: dict[str, Any] = read_config_file(path) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    from_env = env_overrides(env)
    if isinstance(from_env.get("extra_config"), dict) and isinstance(data.get("extra_config"), dict):
        from_env["extra_config"] = {**data["extra_config"], **from_env["extra_config"]}
    merged = {**data, **from_env, **dict(overrides or {})}
    try:
        return EngineConfig.model_validate(merged)
    except ValidationError as e:
        raise _config_error(e, source, env=bool(from_env), env_keys=set(from_env)) from None


_FIX_HINTS = {
    "bool_parsing": "; use true or false (yes/no, on/off and 1/0 are accepted too)",
    "bool_type": "; use true or false",
    "int_parsing": "; use a whole number",
    "int_from_float": "; use a whole number",
    "float_parsing": "; use a number",
    "list_type": "; use a list, e.g. [\"hfbucket\"]",
    "dict_type": "; use a mapping of option names to values",
    "string_type": "; use a string",
}


_SHOWN_INPUT = 20  # characters: "maybe", "5GB" help to see; a longer string may be a pasted credential


def _got(value: Any) -> str:
    """The rejected value, as the error shows it: short scalars as they are, anything else by kind."""
    if isinstance(value, str) and len(value) > _SHOWN_INPUT:
        return f", got a {len(value)}-character string"
    if isinstance(value, Mapping | list | tuple):
        return f", got a {type(value).__name__}"
    return f", got {redact(repr(value))}"


def _config_error(
    e: ValidationError, source: str, *, env: bool, env_keys: set[str] | None = None
) -> ConfigError:
    fields = list(EngineConfig.model_fields)
    lines = []
    for err in e.errors():
        loc = [str(x) for x in err["loc"]]
        key = loc[0] if loc else ""
        origin = f"{ENV_PREFIX}{key.upper()}" if env_keys and key in env_keys else source
        if err["type"] == "extra_forbidden" and key in LMCACHE_ONLY_KEYS:
            lines.append(
                f"config key {key!r} ({origin}) is an LMCache setting that kvbucket's engine config does not "
                f"use; remove it from the file kvbucket reads (kvbucket takes: {', '.join(fields)})"
            )
            continue
        if err["type"] == "extra_forbidden":
            hint = unknown_key_hint(EngineConfig, err["loc"])
            known = ", ".join(keys_at(EngineConfig, err["loc"]))
            lines.append(f"unknown config key {'.'.join(loc)!r} ({origin}): {hint}known keys: {known}")
            continue
        msg = err["msg"].removeprefix("Value error, ") + _FIX_HINTS.get(err["type"], "") + value_hint(err)
        if not key:  # a model-level check: it may involve the file and the environment
            env_vars = ", ".join(f"{ENV_PREFIX}{k.upper()}" for k in sorted(env_keys or ()))
            lines.append(f"{msg} ({source}{' + ' + env_vars if env_vars else ''})")
            continue
        shown = "" if key == "extra_config" or any(looks_secret(p) for p in loc) else _got(err.get("input"))
        field = EngineConfig.model_fields.get(key)
        what = f" ({field.description})" if field is not None and field.description else ""
        lines.append(f"config key {'.'.join(loc)!r}{what} ({origin}): {msg}{shown}")
    return ConfigError("invalid kvbucket engine config:\n  " + "\n  ".join(lines))


__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "GB",
    "LMCACHE_ONLY_KEYS",
    "EngineConfig",
    "env_overrides",
    "load_engine_config",
    "read_config_file",
]
