"""The engine config, where users import it from: ``EngineConfig``, ``load_engine_config``,
``build_backend`` (see :mod:`kvbucket.engine_config` for the keys and their checks).

The imports run one way. The settings live in :mod:`kvbucket.engine_config`, which the backends
read; ``build_backend`` lives in :mod:`kvbucket.backends.build`, next to the tiers it builds, and
this module hands it out on first use (a module ``__getattr__``), so importing the config
imports no backend. An import linter sees ``config -> engine_config``, ``config ->
backends.build`` and ``backends.* -> engine_config``: no circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbucket.engine_config import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    GB,
    LMCACHE_ONLY_KEYS,
    EngineConfig,
    env_overrides,
    load_engine_config,
    read_config_file,
)

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports it on first use
    from kvbucket.backends.build import build_backend


def __getattr__(name: str) -> Any:
    """``kvbucket.config.build_backend``, kept for existing imports (README, seeds)."""
    if name == "build_backend":
        from kvbucket.backends.build import build_backend

        return build_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "GB",
    "LMCACHE_ONLY_KEYS",
    "EngineConfig",
    "build_backend",
    "env_overrides",
    "load_engine_config",
    "read_config_file",
]
