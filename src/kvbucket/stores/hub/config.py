"""Configuration of the Hugging Face bucket store (seed 000 / seed 001 fields).

One pydantic model, :class:`HFBucketConfig`, used three ways: built directly by Python callers,
from an ``hf://buckets/...`` URL (``open_store``), and from LMCache-style
``remote_storage_plugin.<name>.*`` options (:func:`config_from_plugin_options`, which accepts
LMCache's lenient booleans). The MP L2 adapter subclasses it to add capacity and eviction, so
fields here are stable and strict: a wrong type or an unknown field is an error naming it.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvbucket.did_you_mean import closest, did_you_mean, unknown_key_hint, value_hint
from kvbucket.errors import ConfigError, InvalidKeyError
from kvbucket.secrets import reveal
from kvbucket.stores.base import check_prefix
from kvbucket.stores.hub.xet.turns import default_slots
from kvbucket.stores.part_sizes import PART_SIZE_KEYS, check_part_bytes
from kvbucket.stores.urls import HANDLE_SCHEME, is_hub_name

DEFAULT_TMP_DIR_NAME = "kvbucket-hfbucket"


@dataclass(frozen=True, slots=True)
class BucketLocation:
    """A parsed ``hf://buckets/<namespace>/<bucket>[/<prefix>]`` handle."""

    namespace: str
    bucket: str
    prefix: str

    @property
    def bucket_id(self) -> str:
        return f"{self.namespace}/{self.bucket}"

    @property
    def handle(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{HANDLE_SCHEME}{self.bucket_id}{tail}"


def _check_bucket_name(kind: str, value: str, handle: str, what: str) -> str:
    if not is_hub_name(value):
        raise ConfigError(
            f"{what} {handle!r}: {kind} {value!r} is not a valid Hub name (1-96 characters of "
            "letters, digits, '-', '_', '.'; not starting or ending with '-' or '.'; no '--' or '..')"
        )
    return value


def _meant_handle(handle: str) -> str | None:
    """The ``hf://buckets/...`` handle a malformed one likely meant: a misspelt ``buckets``
    segment (``hf://bucket/alice/kv``) is replaced, a missing one (``hf://alice/kv``) added."""
    rest = handle.removeprefix("hf://")
    first, _, tail = rest.partition("/")
    if "/" in tail and closest(first, ["buckets"]) is not None:  # hf://bucket/alice/kv
        return HANDLE_SCHEME + tail
    if first in _REPO_KINDS:  # hf://datasets/alice/kv names a repository, which holds no bucket
        return None
    if handle.startswith("hf://") or "/" in handle:
        return HANDLE_SCHEME + rest.removeprefix("buckets/")
    return None


#: the kinds of Hub repository an ``hf://`` path can name (huggingface_hub's HfFileSystem): not buckets
_REPO_KINDS = ("datasets", "spaces", "models")


def parse_bucket_handle(handle: str, what: str = "bucket_handle") -> BucketLocation:
    """Parse and validate a bucket handle; errors say what is wrong and show the expected form.
    ``what`` names the handle in them (``bucket_handle`` in a config, ``store URL`` for a URL)."""
    form = "hf://buckets/<namespace>/<bucket>[/<prefix>]"
    if not isinstance(handle, str) or not handle.strip():
        raise ConfigError(f"{what} is required, in the form {form}")
    handle = handle.strip()
    if not handle.startswith(HANDLE_SCHEME):
        meant = _meant_handle(handle)
        hint = f" (did you mean {meant}?)" if meant else ""
        if handle.removeprefix("hf://").partition("/")[0] in _REPO_KINDS:
            hint = (" (that names a Hub repository; kvbucket stores in Storage Buckets: create one with "
                    "`hf buckets create <namespace>/<bucket>`)")
        raise ConfigError(f"{what} {handle!r} must start with {HANDLE_SCHEME!r}: use {form}{hint}")
    rest = handle[len(HANDLE_SCHEME) :]
    if "?" in rest or "#" in rest:
        raise ConfigError(f"{what} {handle!r} must not contain '?' or '#'; use {form}")
    parts = rest.split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ConfigError(f"{what} {handle!r} names no bucket; use {form}")
    namespace = _check_bucket_name("namespace", parts[0], handle, what)
    bucket = _check_bucket_name("bucket name", parts[1], handle, what)
    raw_prefix = parts[2] if len(parts) == 3 else ""
    try:
        prefix = check_prefix(raw_prefix)
    except InvalidKeyError as e:
        raise ConfigError(f"{what} {handle!r} has an invalid prefix: {e}") from None
    return BucketLocation(namespace, bucket, prefix)


def check_endpoint_url(value: str, where: str) -> str:
    """``value`` without its trailing ``/`` if it is an http(s) URL with a host (and a valid port),
    else a :class:`ConfigError` naming ``where`` it came from and the form to use."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value.strip())
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{where} {value!r} is not an http(s) URL; set it to the Hub's root, e.g. "
                          "https://huggingface.co or http://127.0.0.1:PORT for the emulator")
    return value.strip().rstrip("/")


def check_hf_endpoint_env() -> None:
    """A malformed ``$HF_ENDPOINT`` as a ConfigError, before huggingface_hub is imported (its import
    reads the variable and prints its own error)."""
    env = os.environ.get("HF_ENDPOINT", "").strip()
    if env:
        check_endpoint_url(env, "$HF_ENDPOINT")


def default_download_tmp_dir() -> Path:
    """Where downloads are staged when no ``download_tmp_dir`` is set (the system temp dir)."""
    return Path(tempfile.gettempdir()) / DEFAULT_TMP_DIR_NAME


class HFBucketConfig(BaseModel):
    """Settings of one Hugging Face bucket store. Never prints its token (``SecretStr``).

    ``token_env`` wins over ``token`` (a deployment's environment overrides a file); when both are
    empty, huggingface_hub's own resolution applies (``HF_TOKEN``, then the saved login).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    bucket_handle: str = Field(description="hf://buckets/<namespace>/<bucket>[/<prefix>]")
    token_env: str = Field("HF_TOKEN", description="environment variable holding the access token")
    token: SecretStr | None = Field(None, description="access token, used when $token_env is unset")
    create_bucket_if_missing: StrictBool = Field(
        False, description="create the bucket (private) on the first store instead of failing"
    )
    download_tmp_dir: str | None = Field(
        None, description="staging dir for downloads that cannot stream into memory; /dev/shm/... on Linux"
    )
    metadata_cache_ttl_secs: float = Field(30.0, ge=0, description="TTL of cached existence and sizes")
    num_workers: int = Field(4, ge=1, le=256, strict=True, description="concurrent Hub/Xet requests")
    load_concurrency: int = Field(
        64, ge=1, le=1024, strict=True,
        description="objects of one load in flight at once (a prompt's chunks in one round trip)",
    )
    read_connections: int = Field(
        64, ge=1, le=1024, strict=True,
        description="ranged GETs of loads in flight at once (a real link caps each connection: a load "
        "fills it only with many); objects are grouped in runs only when they outnumber it",
    )
    read_part_bytes: int = Field(
        8 << 20, ge=0, le=1 << 40, strict=True,
        description="objects of at least twice this are read in parts of about this size, in parallel "
        "(one connection each); 0: one GET per object (else at least 65536)",
    )
    read_min_part_bytes: int = Field(
        0, ge=0, le=1 << 40, strict=True,
        description="a load whose fetches would be fewer than read_connections reads its objects in "
        "smaller parts, down to this size (each part a reconstruction request); 0: read_part_bytes only "
        "(else at least 65536). "
        "Pays only on a link capping each connection far below what the client decodes (2 MiB there)",
    )
    read_slots: int = Field(
        default_factory=default_slots, ge=0, le=1024, strict=True,
        description="bodies parsed at once, a turn taken only while a body's bytes are already here "
        "(0: no bound); default one per core, at least 4 (at most 4 while the Python decoder is in use)",
    )
    prefetch_reconstructions: StrictBool = Field(
        True, description="a lookup hit also asks for its Xet reconstruction, so its load is the fetch alone"
    )
    xet_compression: Literal["auto", "none", "lz4", "bg4-lz4"] = Field(
        "auto", description="how uploads compress chunks (hf_xet's xorb.compression_policy; auto sends a "
        "batch that does not compress with none)"
    )
    endpoint: str | None = Field(None, description="Hub URL; default: $HF_ENDPOINT or huggingface.co")
    max_retries: int = Field(5, ge=0, le=20, strict=True, description="retries on 429/5xx/timeouts")
    retry_backoff_secs: float = Field(
        0.5, ge=0, le=60, description="first retry wait; doubles, capped at 8 s"
    )
    # Deadlines (docs/reliability.md): every verb has a total budget, retries included. Lookups
    # and loads are on the inference path (a miss is cheaper than a stall); stores run behind it.
    connect_timeout_secs: float = Field(2.0, gt=0, le=600, description="TCP+TLS connect of one request")
    request_timeout_secs: float = Field(
        30.0, gt=0, le=3600, description="one HTTP request without a byte (and each list page)"
    )
    lookup_timeout_secs: float = Field(
        1.0, gt=0, le=3600, description="total of head_many (inference path): past it, items fail"
    )
    load_timeout_secs: float = Field(
        5.0, gt=0, le=3600, description="total of get_many (inference path): past it, items fail"
    )
    store_timeout_secs: float = Field(
        120.0, gt=0, le=86400, description="total of put_many/delete_many: past it, items fail"
    )
    # The Hub deletes without a condition (stores/hub/rechecks.py): a deleter bounds its
    # compare-to-delete window, a writer asks again after a longer delay and adds back its loss.
    delete_window_secs: float = Field(
        2.0, gt=0, le=600, description="a delete by version is sent within half of this after its compare "
        "(paths-info), else compared again; no send or retry starts past it; shorter than recheck_delay_secs"
    )
    recheck_delay_secs: float = Field(
        5.0, ge=0, le=3600, description="this long after a commit, the writer asks whether what it wrote is "
        "still there and adds back by its hash what a racing delete removed; 0: off (the window stays open)"
    )
    breaker_failures: int = Field(
        5, ge=0, le=1000, strict=True, description="consecutive failed calls that open the breaker; 0: off"
    )
    breaker_cooldown_secs: float = Field(
        10.0, ge=0, le=3600, description="open breaker: seconds before one call probes the store"
    )

    @field_validator("bucket_handle")
    @classmethod
    def _valid_handle(cls, v: str) -> str:
        return parse_bucket_handle(v).handle

    @field_validator("token_env")
    @classmethod
    def _valid_env_name(cls, v: str) -> str:
        if v and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"token_env must be an environment variable name, got {v!r}")
        return v

    @field_validator("endpoint")
    @classmethod
    def _valid_endpoint(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"endpoint must be an http(s) URL such as https://huggingface.co, got {v!r}")
        return check_endpoint_url(v, "endpoint")

    @field_validator(
        "metadata_cache_ttl_secs", "retry_backoff_secs", "connect_timeout_secs", "request_timeout_secs",
        "lookup_timeout_secs", "load_timeout_secs", "store_timeout_secs", "breaker_cooldown_secs",
        "delete_window_secs", "recheck_delay_secs", mode="before",
    )
    @classmethod
    def _number_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"must be a number, got {v!r}")
        return v

    @field_validator("read_part_bytes", "read_min_part_bytes", mode="before")
    @classmethod
    def _part_floor(cls, v: object, info: ValidationInfo) -> int:
        """0 or 64 KiB..1 TiB (a part is a request), spelt as every part-size setting is."""
        return check_part_bytes("", v, echo=False)  # the model's error names the field

    @model_validator(mode="after")
    def _recheck_after_window(self) -> HFBucketConfig:
        if 0 < self.recheck_delay_secs <= self.delete_window_secs:
            raise ValueError(
                f"recheck_delay_secs={self.recheck_delay_secs:g} must be longer than delete_window_secs="
                f"{self.delete_window_secs:g} (a writer asks again only after any racing delete has landed); "
                "raise recheck_delay_secs, lower delete_window_secs, or set recheck_delay_secs=0 (off)")
        return self

    # ---- derived values -------------------------------------------------------------------
    @property
    def location(self) -> BucketLocation:
        return parse_bucket_handle(self.bucket_handle)

    @property
    def bucket_id(self) -> str:
        return self.location.bucket_id

    @property
    def prefix(self) -> str:
        return self.location.prefix

    def resolved_token(self) -> str | None:
        """The token to send: ``$token_env`` when set and non-empty, else ``token``, else None."""
        if self.token_env:
            env = os.environ.get(self.token_env, "")
            if env:
                return reveal(env)
        return reveal(self.token)

    def token_source(self) -> str:
        """Words naming where the token comes from, for error messages (never the token itself)."""
        env_name = self.token_env or "HF_TOKEN"
        if self.token_env and os.environ.get(self.token_env):
            return f"${self.token_env}"
        if self.token is not None:
            return "the 'token' option"
        from huggingface_hub import constants

        saved = str(constants.HF_TOKEN_PATH)
        if os.path.isfile(saved):
            return f"the saved Hugging Face login in {saved} (${env_name} is unset)"
        return f"nowhere: ${env_name} is unset and there is no saved login (`hf auth login`)"

    def resolved_endpoint(self) -> str:
        """``endpoint``, else ``$HF_ENDPOINT`` read now, else huggingface_hub's configured endpoint."""
        if self.endpoint:
            return self.endpoint
        env = os.environ.get("HF_ENDPOINT", "").strip()
        if env:
            return check_endpoint_url(env, "$HF_ENDPOINT")
        from huggingface_hub import constants

        return str(constants.ENDPOINT).rstrip("/")

    def resolved_tmp_dir(self) -> Path:
        if self.download_tmp_dir:
            return Path(self.download_tmp_dir).expanduser()
        return default_download_tmp_dir()


def build_config(cls: type[HFBucketConfig] = HFBucketConfig, /, **fields: Any) -> HFBucketConfig:
    """Validate ``fields`` into ``cls``, turning pydantic's report into one :class:`ConfigError`."""
    try:
        return cls(**fields)
    except ValidationError as e:
        raise ConfigError(_describe(e, cls)) from None


#: how a config error starts (the settings, not the class that holds them)
INVALID = "invalid Hub bucket store settings"


def _describe(e: ValidationError, cls: type[BaseModel]) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(cls.model_fields))
            hint = unknown_key_hint(cls, err["loc"])
            lines.append(f"unknown option {loc!r} ({hint}known options: {known})")
        else:
            msg = err["msg"].removeprefix("Value error, ") + value_hint(err)
            # Never echo the input of the token field; other inputs are safe to show.
            hidden = loc in ("token", "bucket_handle") or "input" not in err
            shown = "" if hidden else f" (got {err['input']!r})"
            lines.append(f"{loc}: {msg}{shown}")
    return f"{INVALID}: " + "; ".join(lines)


# ---- LMCache-style plugin options ----------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LENIENT_BOOLS = ("create_bucket_if_missing", "prefetch_reconstructions")
#: Every number setting, derived from the model: LMCache hands plugin options as strings, and a
#: hand-kept list missed settings added later (issue 39: recheck_delay_secs, delete_window_secs).
#: The part sizes are left to the model's own parser (part_sizes.check_part_bytes), as for S3.
_LENIENT_NUMBERS: dict[str, type] = {k: f.annotation for k, f in HFBucketConfig.model_fields.items()
                                     if f.annotation in (int, float) and k not in PART_SIZE_KEYS}


def lenient_bool(key: str, value: Any) -> bool:
    """LMCache parses plugin booleans as "1/true/yes/on"; so do we, but anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key} must be a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def config_from_plugin_options(
    instance_name: str, options: dict[str, Any], cls: type[HFBucketConfig] = HFBucketConfig
) -> HFBucketConfig:
    """Build a config from the keys under ``remote_storage_plugin.<instance_name>.``.

    YAML/env values may arrive as strings ("30", "false"), as LMCache accepts them; numbers and
    booleans are converted here and everything else is validated strictly.
    """
    key_prefix = f"remote_storage_plugin.{instance_name}."
    fields: dict[str, Any] = {}
    for k, v in options.items():
        if k in _LENIENT_BOOLS:
            v = lenient_bool(key_prefix + k, v)
        elif k in _LENIENT_NUMBERS and isinstance(v, str):
            try:
                v = _LENIENT_NUMBERS[k](v.strip())
            except ValueError:
                raise ConfigError(f"{key_prefix}{k} must be a number, got {v!r}") from None
        elif k == "token_env" and v is None:
            v = ""
        fields[k] = v
    unknown = [k for k in fields if k not in cls.model_fields]
    if unknown:  # before "bucket_handle is required": a misspelt bucket_handle is the likely cause
        hint = did_you_mean(unknown[0], cls.model_fields)
        raise ConfigError(f"remote_storage_plugin.{instance_name}: unknown option {unknown[0]!r} "
                          f"({hint}known options: {', '.join(sorted(cls.model_fields))})")
    if "bucket_handle" not in fields:
        raise ConfigError(
            f"{key_prefix}bucket_handle is required for the {instance_name!r} plugin, "
            "e.g. hf://buckets/my-org/lmcache-kv/prod"
        )
    try:
        return cls(**fields)
    except ValidationError as e:
        msg = _describe(e, cls).removeprefix(f"{INVALID}: ")
        raise ConfigError(f"remote_storage_plugin.{instance_name}: {msg}") from None


__all__ = [
    "HANDLE_SCHEME",
    "BucketLocation",
    "HFBucketConfig",
    "build_config",
    "config_from_plugin_options",
    "default_download_tmp_dir",
    "lenient_bool",
    "parse_bucket_handle",
]
