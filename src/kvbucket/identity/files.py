"""Which files make a model directory's identity, and whether it is a Hub cache snapshot.

Every file under the directory counts, recursively (directory symlinks followed, a cycle
skipped), except :data:`EXCLUDED_NAMES` / :data:`EXCLUDED_SUFFIXES`: files that cannot change
the KV bytes of the same token ids (a tokenizer's files change the token ids, hence every prefix
key, so leaving them out is safe), hidden entries (``.git``, ``.cache``) and the top-level
``config.json`` (parsed whole instead, :func:`kvbucket.identity.core.config_fields`). A file no
list knows counts (``params.json``, ``quantize_config.json``, remote code ``*.py``, ...): a
change to it is a miss, never stale KV. Any error listing or stat'ing an entry (an unreadable
subdirectory, a broken symlink) is an error (:class:`ModelFilesError`): the identity is not
known, never computed from the files that could be seen.

A Hub cache snapshot is recognised only where huggingface_hub's cache layout really is (as its
``scan_cache_dir`` reads it): ``<cache>/models--<org>--<name>/snapshots/<commit>/``, every file in
it a symlink whose first hop lands in ``../../blobs/``. Anything else (a copy of a snapshot, a
directory merely named ``snapshots/<hex>``) is hashed as files.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from kvbucket.errors import ConfigError

#: Files left out of the identity, by name at any depth: they cannot change the KV bytes of the
#: same token ids. Tokenizer files (another tokenizer gives other token ids, so other prefix keys),
#: generation settings (sampling happens after the KV), chat templates (they change the text, so
#: the token ids), documentation and licences.
EXCLUDED_NAMES: frozenset[str] = frozenset({
    "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.model.v3",
    "tokenizer.model.v7", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json",
    "chat_template.json", "chat_template.jinja",
    "LICENSE", "LICENCE", "LICENSE.txt", "LICENSE.md", "NOTICE", "COPYING", "USE_POLICY.md",
})
#: Suffixes left out likewise: documentation (``README.md``), chat templates, tiktoken vocabularies.
EXCLUDED_SUFFIXES: tuple[str, ...] = (".md", ".jinja", ".tiktoken")
#: Names that are weights (the scan must find at least one, see :func:`has_weights`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
                   ".npz", ".npy", ".onnx", ".pkl", ".nemo", ".distcp")
#: Any other file at least this large is taken as weights too (a name no suffix list knows).
LARGE_FILE = 4 << 20
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

FileStat = tuple[str, str, os.stat_result]  # (name relative to the directory, real path, its stat)


class ModelFilesError(ConfigError):
    """A model path whose identity cannot be computed (missing, no weights, unreadable)."""


class NoWeightsError(ModelFilesError):
    """A model path with no weight file (an engine's tier then names chunks by model name only)."""


def excluded(rel: str) -> bool:
    """Whether the file at ``rel`` (relative to the model directory) is left out."""
    name = rel.rsplit("/", 1)[-1]
    return rel == "config.json" or name in EXCLUDED_NAMES or name.endswith(EXCLUDED_SUFFIXES)


def is_weight(name: str, size: int) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or size >= LARGE_FILE


def has_weights(stats: list[FileStat]) -> bool:
    return any(is_weight(rel, st.st_size) for rel, _, st in stats)


def _entry_stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ModelFilesError(f"{path} is a broken symlink (to {os.readlink(path)}): "
                                  "fix or remove it") from None
        raise


def model_file_stats(path: str | os.PathLike[str]) -> list[FileStat]:
    """``(relative name, real path, stat)`` of every file of the model at ``path`` that counts
    (see the module docstring), sorted by name; ``path`` itself when it is a file. Raises
    :class:`ModelFilesError` or :class:`OSError` when an entry cannot be listed or stat'ed."""
    p = Path(path)
    st = os.stat(p)  # FileNotFoundError / PermissionError: the caller says what to do
    if stat.S_ISREG(st.st_mode):
        return [(p.name, os.path.realpath(p), st)]
    if not stat.S_ISDIR(st.st_mode):
        raise ModelFilesError(f"{p} is neither a file nor a directory")
    out: list[FileStat] = []

    def visit(d: str, real_d: str, rel: str, ancestors: frozenset[tuple[int, int]]) -> None:
        """``real_d``: ``d`` with its symlinks resolved (an entry's real path without a syscall)."""
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise ModelFilesError(f"cannot list {d} ({e.strerror or e}): make it readable") from e
        for e in entries:
            if e.name.startswith("."):
                continue
            name = f"{rel}{e.name}"
            if excluded(name) and not e.is_dir():
                continue
            try:
                est = _entry_stat(e.path)
            except OSError as err:
                raise ModelFilesError(f"cannot stat {e.path} ({err.strerror or err}): "
                                      "make it readable") from err
            real = os.path.realpath(e.path) if e.is_symlink() else f"{real_d}/{e.name}"
            if stat.S_ISDIR(est.st_mode):
                key = (est.st_dev, est.st_ino)
                if key not in ancestors:  # a symlink back up the tree: its files are already in
                    visit(e.path, real, name + "/", ancestors | {key})
            elif stat.S_ISREG(est.st_mode):
                out.append((name, real, est))
            else:
                raise ModelFilesError(f"{e.path} is not a regular file (a pipe, socket or device)")

    visit(str(p), os.path.realpath(p), "", frozenset({(st.st_dev, st.st_ino)}))
    return out


def hub_snapshot_commit(path: str | os.PathLike[str]) -> str | None:
    """The commit of a real Hub cache snapshot directory (see the module docstring), else None."""
    for p in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):
        if _is_snapshot(p):
            return p.name
    return None


def _is_snapshot(p: Path) -> bool:
    repo = p.parent.parent
    if not (_COMMIT_RE.match(p.name) and p.parent.name == "snapshots" and repo.name.startswith("models--")
            and p.is_dir()):
        return False
    blobs = repo / "blobs"
    for dirpath, _dirnames, filenames in os.walk(p, onerror=_raise):
        for name in filenames:
            f = os.path.join(dirpath, name)
            if not os.path.islink(f):
                return False  # a regular file: not what huggingface_hub writes (a copy, or edited)
            first_hop = Path(os.path.abspath(os.path.join(dirpath, os.readlink(f))))
            if first_hop.parent != blobs:
                return False
    return True


def _raise(err: OSError) -> None:
    raise err


__all__ = ["EXCLUDED_NAMES", "EXCLUDED_SUFFIXES", "LARGE_FILE", "WEIGHT_SUFFIXES", "ModelFilesError",
           "NoWeightsError", "excluded", "has_weights", "hub_snapshot_commit", "is_weight",
           "model_file_stats"]
