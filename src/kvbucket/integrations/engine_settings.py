"""The settings every engine tier takes (SGLang's HiCache backend, vLLM's secondary tier).

Each engine hands kvbucket a JSON object of its own (SGLang's extra config, a vLLM
``secondary_tiers`` entry); the store, its envelope and encryption keys, the fleet and
read-ahead keys are the same in both, and are checked the same way: a missing ``store_url``
says where it goes, any other mistake is one ConfigError naming the key.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import ConfigDict, Field, ValidationError

from kvbucket.did_you_mean import closest
from kvbucket.errors import ConfigError
from kvbucket.integrations.engine_fleet import FleetSettings
from kvbucket.integrations.engine_identity import IdentitySettings
from kvbucket.l2.config import format_validation_error
from kvbucket.stores.guard.read_ahead_config import ReadAheadConfig


class EngineTierSettings(FleetSettings, ReadAheadConfig, IdentitySettings):
    """``store_url``, ``store_options``, ``unsealed`` and ``encryption``, with the fleet,
    read-ahead and model identity keys. ``cache_salt`` and ``prefix`` are each engine's own
    (their defaults and the objects they name differ)."""

    model_config = ConfigDict(extra="forbid")

    store_url: str = Field(description="store URL: hf://buckets/ORG/NAME[/p], s3://BUCKET[/p], a path")
    store_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of open_store")
    unsealed: str = Field("miss", description="objects without kvbucket's envelope: miss (default) or accept")
    encryption: Any = Field(None, description="encryption setting, as for kvbucket's other tiers")

    @classmethod
    def validated(cls, values: dict[str, Any], *, no_store_url: str, invalid: str) -> Self:
        """``values`` as settings; ``no_store_url`` is the error without ``store_url`` (say where
        it goes), ``invalid`` the words before any other validation error."""
        if "store_url" not in values:
            typo = next((k for k in values if closest(k, ["store_url"])), None)
            raise ConfigError(f"{invalid}: unknown key {typo!r}: did you mean 'store_url'?" if typo
                              else no_store_url)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, invalid, cls)) from None


__all__ = ["EngineTierSettings"]
