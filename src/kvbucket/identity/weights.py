"""The weights part of a model identity, without reading (or downloading) the weights.

- A Hub snapshot (``.../models--org--name/snapshots/<commit>/``, or a config that carries
  ``_commit_hash``, as transformers sets it when it resolves a revision): ``hub:<commit>``, free.
- Local weight files: ``files:<digest>``, a BLAKE2b of each weight file's name and size, the first
  :data:`HEAD_BYTES` of it (a safetensors header: every tensor's name, dtype, shape and offset)
  and :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` spread over the file (a fine-tune changes
  nearly every value; a sample sees it). Mtimes are not in the digest (a copy of the same files
  on another machine has other mtimes and must share chunks); they key the per-process cache, so
  the files are read once per process, and again only when one was rewritten.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
HEAD_BYTES = 1 << 20
SAMPLES = 16
SAMPLE_BYTES = 4096
_SNAPSHOT_RE = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

_cache: dict[tuple[Any, ...], str] = {}
_lock = threading.Lock()


def hub_commit(path: str | os.PathLike[str] | None = None, config: Any = None) -> str | None:
    """The resolved Hub commit of a model: from its config's ``_commit_hash`` or from a snapshot
    path of the Hub cache (a symlink farm under ``snapshots/<commit>``). None when neither says."""
    commit = config.get("_commit_hash") if isinstance(config, dict) else getattr(config, "_commit_hash", None)
    if isinstance(commit, str) and _COMMIT_RE.match(commit):
        return commit
    if path:
        m = _SNAPSHOT_RE.search(Path(path).as_posix())
        if m:
            return m.group(1)
    return None


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a model directory (or the file itself), sorted by name."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    return sorted(f for f in p.iterdir() if f.name.endswith(WEIGHT_SUFFIXES) and f.is_file())


def _sample(f: Path, size: int, h: Any) -> None:
    with open(f, "rb", buffering=0) as fh:
        fd = fh.fileno()
        h.update(os.pread(fd, min(HEAD_BYTES, size), 0))
        if size <= HEAD_BYTES:
            return
        span = size - HEAD_BYTES - SAMPLE_BYTES
        for i in range(SAMPLES):
            off = HEAD_BYTES + (span * i) // max(SAMPLES - 1, 1) if span > 0 else HEAD_BYTES
            h.update(os.pread(fd, SAMPLE_BYTES, off))


def files_fingerprint(path: str | os.PathLike[str]) -> str | None:
    """``files:<digest>`` of the weight files under ``path`` (see the module docstring); None
    when there are none. Cached per process by (path, names, sizes, mtimes)."""
    files = weight_files(path)
    if not files:
        return None
    stats = [(f.name, f.stat()) for f in files]
    cache_key = (str(Path(path).resolve()), tuple((n, s.st_size, s.st_mtime_ns) for n, s in stats))
    with _lock:
        hit = _cache.get(cache_key)
    if hit is not None:
        return hit
    h = hashlib.blake2b(digest_size=16, person=b"kvbucket-wts")
    for f, (name, st) in zip(files, stats, strict=True):
        h.update(f"{name}\0{st.st_size}\0".encode())
        _sample(f, st.st_size, h)
    out = f"files:{h.hexdigest()}"
    with _lock:
        _cache[cache_key] = out
    return out


def weights_identity(path: str | os.PathLike[str] | None, config: Any = None,
                     revision: str | None = None) -> str:
    """The weights part of an identity: ``hub:<commit>``, else ``files:<digest>``, else
    ``revision:<text>`` (a revision the engine was given but did not resolve), else ``""``."""
    commit = hub_commit(path, config)
    if commit:
        return f"hub:{commit}"
    if revision and _COMMIT_RE.match(revision):
        return f"hub:{revision}"
    if path and Path(path).exists():
        fp = files_fingerprint(path)
        if fp:
            return fp
    return f"revision:{revision}" if revision else ""


__all__ = ["files_fingerprint", "hub_commit", "weight_files", "weights_identity"]
