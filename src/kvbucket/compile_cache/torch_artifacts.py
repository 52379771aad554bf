"""torch.compile's portable cache artifacts as entries of the ``torch`` layout.

``torch.compiler.save_cache_artifacts()`` serializes what this process compiled (Inductor FX
graphs, AOTAutograd, autotuning, Triton kernels); ``load_cache_artifacts()`` puts them into the
local caches of a fresh process, whose next ``torch.compile`` then hits instead of compiling.
The blob is only valid for the same torch (and Triton) version and device, so those name the
group; the user's key and the blob's content hash name the entry, so entries never change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from pathlib import Path

from kvbucket.compile_cache.layout import EntryState, TorchLayout
from kvbucket.compile_cache.torch_env import torch_device, torch_group
from kvbucket.compile_cache.transfer import TMP_PREFIX
from kvbucket.errors import ConfigError
from kvbucket.keys import encode_key

log = logging.getLogger("kvbucket.compile_cache")


def key_prefix(key: str) -> str:
    if not key:
        raise ConfigError("the torch compile cache needs a key (e.g. the model id and its compile options)")
    return f"{encode_key(key)}-"


def entry_name(group: str, key: str, blob: bytes) -> str:
    return f"{group}/{key_prefix(key)}{hashlib.sha256(blob).hexdigest()[:16]}"


def write_entry(root: Path, group: str, key: str, blob: bytes, info: dict[str, object]) -> str:
    """Write an entry atomically (blob, then its description, in a temp dir renamed into place)."""
    name = entry_name(group, key, blob)
    final = root / name
    if final.is_dir():
        return name  # content-addressed: already there
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        (tmp / TorchLayout.BLOB).write_bytes(blob)
        meta = {"key": key, "group": group, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                "info": info}
        (tmp / TorchLayout.META).write_text(json.dumps(meta, sort_keys=True, default=str))
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return name


def _pairs(info: object) -> set[tuple[str, str]]:
    """(artifact type, key) pairs of a torch ``CacheInfo``."""
    arts = getattr(info, "artifacts", None) or {}
    return {(str(t), str(k)) for t, keys in dict(arts).items() for k in keys}


def save(root: Path, group: str, key: str, known: set[tuple[str, str]] | None = None) -> str | None:
    """Serialize this process's compile artifacts into a local entry.

    None when nothing was compiled, or when every artifact is one ``load`` brought in (``known``):
    a warm process then publishes nothing.
    """
    import torch

    res = torch.compiler.save_cache_artifacts()
    if res is None:
        return None
    blob, info = res
    pairs = _pairs(info)
    if not blob or (known is not None and pairs and pairs <= known):
        return None
    arts = {t: sorted(k for tt, k in pairs if tt == t) for t in sorted({t for t, _ in pairs})}
    return write_entry(root, group, key, blob, {"artifacts": arts})


def load(root: Path, group: str, key: str) -> tuple[list[str], set[tuple[str, str]]]:
    """Load every good local entry of ``key`` into torch's caches.

    Returns the entries loaded and the (type, key) pairs of the artifacts they held.
    """
    import torch

    loaded: list[str] = []
    known: set[tuple[str, str]] = set()
    prefix = f"{group}/{key_prefix(key)}"
    for e in TorchLayout(group).scan(root):
        if e.state is not EntryState.GOOD or not e.name.startswith(prefix):
            continue
        blob = (root / e.name / TorchLayout.BLOB).read_bytes()
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # a bad blob must not stop the compile
            log.warning("could not load torch compile artifacts %s: %s", e.name, exc)
            continue
        loaded.append(e.name)
        known |= _pairs(info)
    return loaded, known


__all__ = ["entry_name", "key_prefix", "load", "save", "torch_device", "torch_group", "write_entry"]
