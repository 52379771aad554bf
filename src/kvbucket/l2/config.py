"""Typed ``--l2-adapter`` JSON specs, parsed strictly.

Every adapter type is a pydantic model in strict mode with unknown fields forbidden, so a typo
(``"num_worker"``), a wrong type (``"num_workers": "8"``) or a string ``"false"`` for a bool is
an error naming the field, instead of a silently ignored or truthy value. Error messages never
echo the offending value (it may be a token).

Fields shared by every type (kvbucket's, on top of each type's own):

- ``num_workers`` (int, default 4): the worker pool doing blocking store calls;
- ``max_capacity_gb`` (float, default 0): the capacity ``get_usage()`` reports and eviction
  works against; 0 means unbounded (usage fraction -1, no eviction);
- ``eviction`` (dict, optional): see :class:`kvbucket.l2.eviction.EvictionConfig`; unset with a
  capacity, the default ``LRU`` policy (a capacity that is set is enforced,
  :func:`kvbucket.l2.eviction.effective_eviction`);
- ``metadata_cache_ttl_secs`` (float, default 30): how long a lookup miss is remembered;
- ``full_chunk_bytes`` (int, optional): the full chunk size; stores of other sizes are
  refused and lookups of other sizes miss. Unset, any size is stored (see :mod:`kvbucket.l2.adapter`);
- ``object_format`` (``"kvbucket"`` default, or ``"lmcache"``): which names (and bytes) new
  objects get. Both read LMCache's built-in adapter's objects too; ``"lmcache"`` writes exactly
  what LMCache 0.5.6's built-in writes, so LMCache nodes read kvbucket's chunks (see
  :mod:`kvbucket.l2.naming`, docs/l2.md);
- ``encryption`` (dict, optional): AES-256-GCM at rest per tenant (``cache_salt``),
  ``{"keyring_file": "/path/keys.json"}`` or ``{"keyring_env": "VAR"}`` (see
  :mod:`kvbucket.encryption`; docs/integrity.md);
- ``unsealed`` (``"miss"`` or ``"accept"``, default ``"miss"``): what a load does with an object
  that has no kvbucket envelope (see :mod:`kvbucket.stores.guard.sealed`);
- ``read_ahead`` (bool, default true), ``read_ahead_max_gb`` (float, default 1),
  ``read_ahead_ttl_secs`` (float, default 10): a lookup hit starts its load into a bounded
  buffer the load then takes from (:mod:`kvbucket.stores.guard.read_ahead`, docs/read-ahead.md);
- ``fleet`` (dict, optional): share the prefix's capacity with every other node using it
  (see :class:`kvbucket.fleet.config.FleetConfig` and docs/fleet.md); ``max_capacity_gb``
  then bounds the whole prefix, not this node's stores;
- ``model_identity`` (string, or an object of model name -> string, ``"*"`` for the others):
  the identity of the model(s) whose keys this adapter serves, a token ``kvbucket du`` shows or
  text naming the weights (``org/model@<commit>``); kvbucket's names then carry it and chunks of
  other identities are misses, never deleted (:mod:`kvbucket.identity`). Unset, chunks are
  shared by model name only (a warning says so once);
- ``accept_name_only`` (bool, default false): with ``model_identity``, also read chunks named
  by model name only (written before identities, or by LMCache's own adapters);
- ``metrics_port`` (int, optional), ``metrics_addr`` (default ``"127.0.0.1"``): LMCache's
  adapter and connector serve kvbucket's Prometheus metrics on ``http://addr:port/metrics``,
  once per process (:func:`kvbucket.metrics_server.serve_metrics`; docs/monitoring.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvbucket.did_you_mean import did_you_mean, unknown_key_hint
from kvbucket.encryption import EncryptionConfig
from kvbucket.errors import ConfigError
from kvbucket.fleet.config import FleetConfig
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.metrics_server import MetricsEndpointConfig
from kvbucket.stores.guard.read_ahead_config import ReadAheadConfig
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.s3.config import S3Config

GIB = 1024**3


class L2CommonConfig(ReadAheadConfig, MetricsEndpointConfig):
    """The fields every kvbucket L2 adapter type accepts."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    num_workers: int = Field(4, ge=1, le=512)
    max_capacity_gb: float = Field(0.0, ge=0.0)
    eviction: EvictionConfig | None = None
    metadata_cache_ttl_secs: float = Field(30.0, ge=0.0)
    full_chunk_bytes: int | None = Field(None, gt=0)
    object_format: Literal["kvbucket", "lmcache"] = "kvbucket"
    fleet: FleetConfig | None = None
    encryption: EncryptionConfig | None = None
    unsealed: Literal["miss", "accept"] = "miss"
    model_identity: str | dict[str, str] | None = None
    accept_name_only: bool = False

    @property
    def max_capacity_bytes(self) -> int:
        return int(self.max_capacity_gb * GIB)

    @model_validator(mode="after")
    def _eviction_needs_a_capacity(self) -> L2CommonConfig:
        # Refused before the store opens: an eviction policy without a capacity never evicts.
        ev = self.eviction
        if ev is not None and ev.eviction_policy != "noop" and self.max_capacity_gb <= 0:
            raise ValueError(
                f"eviction {self.eviction.eviction_policy} is set without a capacity, so it would never "
                "evict (an unbounded bucket); add max_capacity_gb next to it, or remove \"eviction\""
            )
        return self


class FsL2Config(L2CommonConfig):
    """``{"type": "fs", "base_path": "/var/cache/kv"}``: a directory (FileStore)."""

    type: Literal["fs"] = "fs"
    base_path: str = Field(min_length=1)
    fsync: bool = False


class HFBucketL2Config(HFBucketConfig, L2CommonConfig):
    """Seed 000's fields: ``{"type": "hfbucket", "bucket_handle": "hf://buckets/org/name[/prefix]"}``.

    Every field of the hfbucket store's :class:`~kvbucket.stores.hub.config.HFBucketConfig`
    (``bucket_handle``, ``token_env``, ``token``, ``create_bucket_if_missing``,
    ``download_tmp_dir``, ``metadata_cache_ttl_secs``, ``num_workers``, and kvbucket's
    ``endpoint``/``max_retries``/``retry_backoff_secs``) plus the adapter fields above.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, validate_default=True)

    type: Literal["hfbucket"] = "hfbucket"


class S3L2Config(S3Config, L2CommonConfig):
    """Seed 004's MP fields: ``{"type": "s3", "s3_endpoint": "s3://bucket", "s3_region": "..."}``.

    Every field of the s3 store's :class:`~kvbucket.stores.s3.config.S3Config` (``s3_endpoint`` as
    ``s3://bucket[/prefix]`` or a bare bucket host, ``s3_region``, ``s3_num_io_threads``,
    ``s3_prefer_http2``, ``s3_enable_s3express``, ``disable_tls``, ``aws_access_key_id``,
    ``aws_secret_access_key``, and kvbucket's ``s3_endpoint_url`` etc. for S3-compatible servers)
    plus the adapter fields above.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    type: Literal["s3"] = "s3"
    num_workers: int = Field(8, ge=1, le=512)


def format_validation_error(e: ValidationError, where: str,
                            fields: Iterable[str] | type[BaseModel] = ()) -> str:
    """One line per problem, naming the field, never showing the value (it may be a secret under
    a misspelt key); an unknown field gets the closest key of its level as a suggestion (``fields``:
    the model, whose nested models are followed, or the names of the top level)."""
    lines = []
    for err in e.errors(include_input=False, include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "(spec)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            if isinstance(fields, type):
                hint = unknown_key_hint(fields, err["loc"])
            else:
                hint = did_you_mean(err["loc"][-1], list(fields))
            msg = f"unknown field ({hint}check the spelling; see the docs for the fields this type takes)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{where}: field {field!r}: {msg}")
    return "; ".join(lines)


def load_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON object string or a dict, as a dict (a copy)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the L2 adapter spec is not valid JSON: {e.msg} at char {e.pos}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"the L2 adapter spec must be a JSON object, got {type(spec).__name__}")
    return dict(spec)


__all__ = [
    "GIB",
    "EncryptionConfig",
    "FsL2Config",
    "HFBucketL2Config",
    "L2CommonConfig",
    "S3L2Config",
    "format_validation_error",
    "load_spec",
]
