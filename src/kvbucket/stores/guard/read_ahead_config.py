"""Read-ahead settings (:mod:`kvbucket.stores.guard.read_ahead`), as one set of keys every config surface
shares: the engine config, the L2 adapter and connector config, the SGLang and vLLM tiers.

Import-light (pydantic only), so configuration models can mix it in without the store machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvbucket.errors import ConfigError

GiB = 1024**3
#: The allowed ranges: finite, and short of what a timer or an int can hold (a TTL of 1e300 s
#: killed the sweeper with OverflowError; a bound of inf GB raised one from int()).
MAX_GB = 1024.0
MAX_TTL_SECS = 86400.0
_RANGES = {
    "read_ahead_max_gb": "a number of GB from 0 to 1024",
    "read_ahead_ttl_secs": "a number of seconds above 0, at most 86400 (a day)",
}


def _in_range(key: str, value: float) -> bool:
    if not math.isfinite(value):
        return False
    if key == "read_ahead_max_gb":
        return 0 <= value <= MAX_GB
    return 0 < value <= MAX_TTL_SECS


def range_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the read-ahead key ``key`` (naming the allowed range), or None."""
    if key not in _RANGES or (isinstance(value, int | float) and _in_range(key, float(value))):
        return None
    return f"{key} must be {_RANGES[key]}, got {value!r}"


@dataclass(frozen=True)
class ReadAheadSettings:
    """``enabled``: lookup hits start their loads; ``max_bytes``: the buffer's bound; ``ttl_secs``:
    how long a read-ahead no load took is kept; ``metrics``: export its series (an engine
    config's ``extra_config.metrics: false`` turns them off with every other series)."""

    enabled: bool = True
    max_bytes: int = GiB
    ttl_secs: float = 10.0
    metrics: bool = True

    def __post_init__(self) -> None:
        for key, value in (("read_ahead_max_gb", self.max_bytes / GiB),
                           ("read_ahead_ttl_secs", self.ttl_secs)):
            if (problem := range_problem(key, value)) is not None:
                raise ConfigError(f"invalid read-ahead setting: {problem}")


class ReadAheadConfig(BaseModel):
    """The three keys; a model that mixes this in gets :meth:`read_ahead_settings`."""

    read_ahead: bool = Field(
        True, description="a lookup hit starts loading the chunk into a bounded buffer, so the load "
        "that follows finds it there or on its way; false: loads fetch only when asked")
    read_ahead_max_gb: float = Field(
        1.0, description="bound of the read-ahead buffer in GB (GiB), 0 to 1024: bytes in flight or "
        "landed and not yet loaded; also the most a lookup never followed by a load can cost")
    read_ahead_ttl_secs: float = Field(
        10.0, description="a read-ahead no load took within this many seconds (above 0, at most "
        "86400) is dropped")

    @field_validator("read_ahead_max_gb", "read_ahead_ttl_secs")
    @classmethod
    def _bounded(cls, value: float, info: Any) -> float:
        if not _in_range(info.field_name, value):
            raise ValueError(f"must be {_RANGES[info.field_name]}, got {value!r}")
        return value

    def read_ahead_settings(self) -> ReadAheadSettings:
        return ReadAheadSettings(self.read_ahead, int(self.read_ahead_max_gb * GiB), self.read_ahead_ttl_secs)


READ_AHEAD_KEYS = frozenset(ReadAheadConfig.model_fields)


class _Keys(ReadAheadConfig):
    model_config = ConfigDict(extra="forbid")


def split_read_ahead_keys(options: Mapping[str, Any], where: str = ""
                          ) -> tuple[dict[str, Any], ReadAheadSettings]:
    """``options`` (a remote tier's ``extra_config``) as (the store's own options, the tier's
    read-ahead settings). ``where`` is how the keys are spelled in the config, for errors."""
    store = {k: v for k, v in options.items() if k not in READ_AHEAD_KEYS}
    try:
        keys = _Keys.model_validate({k: v for k, v in options.items() if k in READ_AHEAD_KEYS})
    except ValidationError as e:
        problems = "; ".join(
            f"extra_config.{where}{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ConfigError(f"invalid read-ahead setting: {problems}") from None
    return store, keys.read_ahead_settings()


__all__ = ["MAX_GB", "MAX_TTL_SECS", "READ_AHEAD_KEYS", "GiB", "ReadAheadConfig", "ReadAheadSettings",
           "range_problem", "split_read_ahead_keys"]
