"""Every ``KVBUCKET_*`` environment variable kvbucket reads, and the warning for one it does not.

A misspelt variable (a letter short of ``KVBUCKET_CHUNK_SIZE``) would otherwise be ignored
without a word: the console script and :func:`kvbucket.config.load_engine_config` warn once
per process for each unknown one, with the closest known name. The engine config's keys are variables too
(``KVBUCKET_<KEY>``, :mod:`kvbucket.engine_config`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping

from kvbucket.did_you_mean import closest

PREFIX = "KVBUCKET_"

#: the variables read outside the engine config (tests/test_env_vars.py checks the source for more)
OTHER_VARIABLES = frozenset({
    "KVBUCKET_COMPILE_CACHE", "KVBUCKET_CONFIG_DIR", "KVBUCKET_CONFIG_FILE", "KVBUCKET_DEMO_SIZE",
    "KVBUCKET_EMULATOR_ADMIN_KEY", "KVBUCKET_EMULATOR_TOKENS", "KVBUCKET_ENCRYPTION_KEY", "KVBUCKET_KEYRING",
    "KVBUCKET_IDENTITY_CACHE", "KVBUCKET_LOG_LEVEL", "KVBUCKET_METRICS_URL", "KVBUCKET_PROGRESS_INTERVAL",
    "KVBUCKET_REMOTE_URL",
    "KVBUCKET_SERVED_CHUNK_KIB", "KVBUCKET_SERVED_ROUNDS", "KVBUCKET_SERVED_SEED", "KVBUCKET_TIMEOUT",
    "KVBUCKET_TORCH_CACHE_DIR", "KVBUCKET_XET_DECODER", "KVBUCKET_XET_UPLOAD_STAGING",
    # the repository's scripts (benchmarks, engine venvs)
    "KVBUCKET_BENCH_KEYRING", "KVBUCKET_BENCH_RESULTS", "KVBUCKET_ENGINE_VENVS",
})

log = logging.getLogger("kvbucket.env")
_warned: set[str] = set()
_lock = threading.Lock()


def known_variables(engine_keys: Iterable[str]) -> set[str]:
    """The variables kvbucket reads, given the engine config's keys (each a ``KVBUCKET_<KEY>``)."""
    return set(OTHER_VARIABLES) | {PREFIX + k.upper() for k in engine_keys}


def unknown_variables(env: Mapping[str, str] | None,
                      engine_keys: Iterable[str]) -> list[tuple[str, str | None]]:
    """(name, closest known name or None) of each ``KVBUCKET_*`` variable kvbucket does not read."""
    env = os.environ if env is None else env
    known = known_variables(engine_keys)
    return [(n, closest(n, known)) for n in sorted(env) if n.startswith(PREFIX) and n not in known]


def may_be_unknown(env: Mapping[str, str] | None = None) -> bool:
    """True when a ``KVBUCKET_*`` variable is set that :data:`OTHER_VARIABLES` does not name: only
    then are the engine config's keys (pydantic, a tenth of a second to import) needed to tell
    whether kvbucket reads it. ``kvbucket --help`` and ``--version`` start without them."""
    env = os.environ if env is None else env
    return any(n.startswith(PREFIX) and n not in OTHER_VARIABLES for n in env)


def warning_text(name: str, close: str | None) -> str:
    hint = f"did you mean {close}?" if close else "kvbucket reads no such variable"
    return f"ignoring {name}: not a kvbucket variable; {hint}"


def warn_unknown(env: Mapping[str, str] | None, engine_keys: Iterable[str], emit: object = None) -> list[str]:
    """Warn once per process for each unknown ``KVBUCKET_*`` variable; the lines warned now.

    ``emit`` (a callable taking the line) replaces the log record, e.g. the CLI's stderr line."""
    lines = []
    for name, close in unknown_variables(env, engine_keys):
        with _lock:
            if name in _warned:
                continue
            _warned.add(name)
        line = warning_text(name, close)
        lines.append(line)
        if callable(emit):
            emit(line)
        else:
            log.warning("%s", line)
    return lines


__all__ = ["OTHER_VARIABLES", "PREFIX", "known_variables", "may_be_unknown", "unknown_variables",
           "warn_unknown", "warning_text"]
