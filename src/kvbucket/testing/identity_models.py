"""Small model directories that differ the ways a redeploy under the same name can differ.

Each is a ``config.json`` and one ``model.safetensors`` (a real safetensors header and random
tensor bytes): ``base``; ``weights`` (other tensor bytes, same config); ``rope`` (the base's
weights, ``rope_scaling`` added); ``revision`` and ``revision2`` (real Hub-cache snapshots of
two commits holding the base's files, :func:`hub_snapshot`); ``copy`` (the base's files copied
elsewhere, other mtimes: the same identity). Used by the identity tests of every engine path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "vocab_size": 128, "_name_or_path": "org/llama",
}
COMMITS = ("a" * 40, "b" * 40)


def write_safetensors(path: Path, seed: int, nbytes: int = 1 << 16) -> None:
    """A valid safetensors file of one uint8 tensor of ``nbytes`` pseudo-random bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytes((seed * 131 + i * 7 + (i >> 8) * 13) & 0xFF for i in range(nbytes))
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _model(root: Path, config: dict[str, Any], seed: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    write_safetensors(root / "model.safetensors", seed)
    return root


def hub_snapshot(repo: Path, commit: str, src: Path) -> Path:
    """``src``'s files as huggingface_hub's cache holds them: ``<repo>/snapshots/<commit>/<name>``,
    each a relative symlink to ``<repo>/blobs/<its sha256>`` (``repo``: ``.../models--org--name``)."""
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def make_model_dirs(tmp: Path) -> dict[str, Path]:
    base = _model(tmp / "local" / "llama", CONFIG, seed=1)
    out = {
        "base": base,
        "weights": _model(tmp / "local-ft" / "llama", CONFIG, seed=2),
        "rope": _model(tmp / "local-rope" / "llama",
                       {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, seed=1),
    }
    for key, commit in zip(("revision", "revision2"), COMMITS, strict=True):
        out[key] = hub_snapshot(tmp / "hub" / "models--org--llama", commit, base)
    copy = tmp / "elsewhere" / "llama"
    shutil.copytree(base, copy)
    os.utime(copy / "model.safetensors", (1_000_000_000, 1_000_000_000))
    out["copy"] = copy
    return out


#: The variants a second process may run under the first one's model name: all must miss.
OTHER_VARIANTS = ("weights", "revision", "rope")

__all__ = ["COMMITS", "CONFIG", "OTHER_VARIANTS", "hub_snapshot", "make_model_dirs", "write_safetensors"]
