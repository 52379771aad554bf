"""The remembered compile-cache target (``kvbucket compile-cache set``) and target resolution."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvbucket.errors import ConfigError
from kvbucket.stores.urls import resolve_store_url

ENV_TARGET = "KVBUCKET_COMPILE_CACHE"
ENV_CONFIG_DIR = "KVBUCKET_CONFIG_DIR"
_SCHEMES = ("hf://buckets/", "s3://", "file://", "memory://")


def config_dir() -> Path:
    """``$KVBUCKET_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/kvbucket``, else ``~/.config/kvbucket``."""
    if d := os.environ.get(ENV_CONFIG_DIR):
        return Path(d).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base).expanduser() / "kvbucket"


def config_path() -> Path:
    return config_dir() / "compile_cache.json"


def check_target(target: str) -> str:
    """Refuse what cannot name a store, with the forms that can."""
    t = resolve_store_url(target.strip())
    if not t:
        raise ConfigError("the compile cache target is empty")
    if "://" in t and not t.startswith(_SCHEMES):
        raise ConfigError(
            f"unsupported compile cache target {target!r}; use hf://buckets/<namespace>/<bucket>[/prefix], "
            "s3://<bucket>[/prefix], file:///abs/dir or a directory path"
        )
    if t.startswith("hf://buckets/") and len(t.removeprefix("hf://buckets/").strip("/").split("/")) < 2:
        raise ConfigError(f"{target!r} does not name a bucket; use hf://buckets/<namespace>/<bucket>")
    if "://" not in t:
        t = str(Path(t).expanduser().absolute())
    return t


def save_target(target: str) -> Path:
    """Remember the target (0600 file, 0700 dir: it names private data)."""
    t = check_target(target)
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"target": t}, f)
    os.replace(tmp, path)
    return path


def saved_target() -> str | None:
    path = config_path()
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}; run `kvbucket compile-cache set TARGET` again") from None
    t = body.get("target") if isinstance(body, dict) else None
    return t if isinstance(t, str) and t else None


def resolve_target(explicit: str | None = None, neuron_remote: str | None = None) -> str | None:
    """Explicit, else ``$KVBUCKET_COMPILE_CACHE``, else an ``s3://`` Neuron cache URL, else ``set``'s."""
    for t in (explicit, os.environ.get(ENV_TARGET), neuron_remote):
        if t:
            return check_target(t)
    return saved_target()


__all__ = ["ENV_CONFIG_DIR", "ENV_TARGET", "check_target", "config_path", "resolve_target", "save_target",
           "saved_target"]
