"""``with compile_cache(...)``: fetch on enter, sync on exit, never break the compile.

The cache is an optimisation, so every remote failure (offline, unreachable bucket, denied
token) degrades to the local cache with ONE warning per block; only bad arguments raise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbucket.compile_cache import torch_artifacts
from kvbucket.compile_cache.fetch import fetch
from kvbucket.compile_cache.layout import CacheLayout, EntryState, get_layout
from kvbucket.compile_cache.neuron_env import resolve_neuron_cache
from kvbucket.compile_cache.settings import resolve_target
from kvbucket.compile_cache.sync import sync
from kvbucket.compile_cache.transfer import ModelScope, TransferReport
from kvbucket.errors import ConfigError, InvalidKeyError
from kvbucket.stores import open_store
from kvbucket.stores.base import ObjectStore

log = logging.getLogger("kvbucket.compile_cache")

DEFAULT_TORCH_CACHE = Path("~/.cache/kvbucket/torch-compile")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


@dataclass
class CompileCacheSession:
    """What a ``compile_cache`` block did; yielded by the context manager."""

    layout: CacheLayout
    cache_dir: Path
    target: str | None
    scope: ModelScope | None
    groups: list[str] | None
    disabled: bool = False
    degraded: str | None = None  # why the block ran local-only
    fetched: TransferReport | None = None
    synced: TransferReport | None = None
    loaded: list[str] = field(default_factory=list)  # torch layout: entries loaded into torch
    torch_known: set[tuple[str, str]] = field(default_factory=set)  # artifacts those entries held
    warnings: int = 0

    def warn(self, msg: str, *args: Any) -> None:
        self.warnings += 1
        log.warning(msg, *args)

    def degrade(self, reason: str) -> None:
        if self.degraded is None:
            self.degraded = reason
            self.warn("compile cache %s: %s; using the local cache only", self.target or "(none)", reason)


def _resolve_dir(layout: CacheLayout,
                 cache_dir: str | os.PathLike[str] | None) -> tuple[Path, str | None, bool]:
    """(local cache dir, remote URL Neuron was pointed at, caching disabled)."""
    if layout.name == "neuron":
        loc = resolve_neuron_cache(cache_dir)
        return loc.local_dir, loc.remote_url, loc.disabled
    if layout.name == "torch":
        d = cache_dir or os.environ.get("KVBUCKET_TORCH_CACHE_DIR") or DEFAULT_TORCH_CACHE
        return Path(d).expanduser(), None, False
    if cache_dir is None:
        raise ConfigError(f"the {layout.name} layout needs cache_dir= (e.g. your TRITON_CACHE_DIR)")
    return Path(cache_dir).expanduser(), None, False


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def compile_cache(
    model_id: str | None = None,
    task: str | None = None,
    export_config: Mapping[str, Any] | None = None,
    target: str | ObjectStore | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    layout: str | CacheLayout = "neuron",
    *,
    key: str | None = None,
    version: str | None = None,
    progress: bool = False,
    lock_timeout: float = 600.0,
    store_options: Mapping[str, Any] | None = None,
) -> Iterator[CompileCacheSession]:
    """Fetch the cache on enter and publish new good entries on exit.

    ``target``: ``hf://buckets/<ns>/<bucket>[/prefix]``, ``s3://bucket[/prefix]``, a path, or an
    open :class:`ObjectStore`; default from ``$KVBUCKET_COMPILE_CACHE``, an ``s3://``
    ``NEURON_COMPILE_CACHE_URL`` (neuron layout), or ``kvbucket compile-cache set``.
    ``model_id``/``task``/``export_config`` select the per-model area and write an export record;
    without ``model_id`` only the flat area is used. ``version`` pins the compiler version (neuron)
    or group (torch/directory). ``key`` names torch artifacts (default: the model id).
    ``store_options`` go to the store (e.g. ``{"max_retries": 1}`` so an outage costs a compile
    less waiting).
    """
    lay = get_layout(layout, version=version)
    root, neuron_remote, disabled = _resolve_dir(lay, cache_dir)
    scope = ModelScope(model_id, task, dict(export_config) if export_config else None) if model_id else None
    if export_config and not model_id:
        raise ConfigError("export_config was given without model_id; records are filed under a model id")
    torch_key = key or model_id or "default"
    if lay.name == "torch":
        torch_artifacts.key_prefix(torch_key)  # validate before compiling anything
    if isinstance(target, ObjectStore):
        store: ObjectStore | None = target
        target_url: str | None = target.url
    else:
        store = None
        target_url = resolve_target(target, neuron_remote)
    session = CompileCacheSession(lay, root, target_url, scope, None, disabled=disabled)
    if disabled:
        log.debug("Neuron caching is disabled (--no-cache in NEURON_CC_FLAGS): compile cache not used")
        yield session
        return
    groups = lay.current_groups()
    session.groups = groups
    if lay.name == "torch" and cache_dir is None:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)  # kvbucket's own dir: private
    select = None
    if lay.name == "torch":
        prefix = torch_artifacts.key_prefix(torch_key)
        select = lambda e: e.split("/", 1)[1].startswith(prefix)  # noqa: E731
    good_at_enter = {e.name for e in lay.scan(root) if e.state is EntryState.GOOD}

    opened_here = False
    if store is None:
        if target_url is None:
            session.degrade("no target configured (pass target=, set $KVBUCKET_COMPILE_CACHE or run "
                            "`kvbucket compile-cache set hf://buckets/<ns>/<bucket>`)")
        elif hub_offline() and target_url.startswith("hf://"):
            session.degrade("HF_HUB_OFFLINE is set")
        else:
            try:
                store = open_store(target_url, **dict(store_options or {}))
                opened_here = True
            except (ConfigError, InvalidKeyError):
                raise
            except Exception as exc:  # an unreachable cache must not stop a compile
                log.debug("opening %s failed", target_url, exc_info=True)
                session.degrade(f"cannot open the target ({_describe(exc)})")
    try:
        if store is not None and session.degraded is None:
            try:
                session.fetched = fetch(store, lay, root, groups=groups, scope=scope, select=select,
                                        progress=progress)
                log.info("compile cache %s", session.fetched.summary())
                if session.fetched.failed:
                    session.warn("compile cache: %d entries could not be fetched (first: %s)",
                                 len(session.fetched.failed), next(iter(session.fetched.failed.items())))
            except Exception as exc:
                log.debug("fetch from %s failed", target_url, exc_info=True)
                session.degrade(f"fetch failed ({_describe(exc)})")
        if lay.name == "torch":
            session.loaded, session.torch_known = torch_artifacts.load(root, (groups or [""])[0], torch_key)
        yield session
    finally:
        try:
            _exit(session, store, root, groups, scope, good_at_enter, torch_key, progress, lock_timeout)
        finally:
            if opened_here and store is not None:
                store.close()


def _exit(session: CompileCacheSession, store: ObjectStore | None, root: Path, groups: list[str] | None,
          scope: ModelScope | None, good_at_enter: set[str], torch_key: str, progress: bool,
          lock_timeout: float) -> None:
    lay = session.layout
    if lay.name == "torch":
        try:
            torch_artifacts.save(root, (groups or [""])[0], torch_key, session.torch_known)
        except Exception as exc:
            session.warn("could not save torch compile artifacts: %s", _describe(exc))
    if store is None or session.degraded is not None:
        return
    attribute = {e.name for e in lay.scan(root) if e.state is EntryState.GOOD} - good_at_enter
    try:
        session.synced = sync(store, lay, root, groups=groups, scope=scope, attribute=attribute,
                              progress=progress, lock_timeout=lock_timeout)
    except Exception as exc:  # never mask the block's own outcome
        log.debug("sync to %s failed", session.target, exc_info=True)
        session.degrade(f"sync failed ({_describe(exc)})")
        return
    log.info("compile cache %s", session.synced.summary())
    if session.synced.failed:
        session.warn("compile cache: %d entries could not be published (first: %s); "
                     "the next sync retries them",
                     len(session.synced.failed), next(iter(session.synced.failed.items())))


__all__ = ["CompileCacheSession", "compile_cache", "hub_offline"]
