"""The weights part of a model identity: a Hub commit, or a digest of every weight byte.

- A Hub snapshot (``.../models--org--name/snapshots/<commit>/``, or a config that carries
  ``_commit_hash``, as transformers sets it when it resolves a revision): ``hub:<commit>``, free.
  (A file edited in place inside the Hub cache keeps the commit: a documented limit.)
- Local files: ``files:<digest>``, an XXH3-128 over every weight file under the directory,
  recursively (:func:`weight_files`): its path relative to the directory, its size and the
  XXH3-128 of its *full content* (:mod:`.digest`). A fine-tune of one tensor anywhere changes
  it; a copy of the same files elsewhere, or a ``touch``, does not (mtimes and paths outside the
  directory are not in it). Each file's digest is kept in the machine's cache
  (:mod:`.local_cache`), so only the first computation on a machine reads the bytes.

The first computation of a large model takes seconds (minutes from a cold disk). Callers that
must not wait ask with ``wait=False``: a background thread computes it and :class:`IdentityPending`
says "not known yet" until it is done (see :func:`weights_job`); never a guessed identity.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from kvbucket.identity.digest import combine, hash_files
from kvbucket.identity.local_cache import DigestCache, default_cache, stat_key

log = logging.getLogger("kvbucket.identity")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
                   ".npz", ".npy", ".onnx", ".pkl", ".nemo", ".distcp")
#: Any other file at least this large counts too (weights under a name no suffix list knows).
LARGE_FILE = 4 << 20
#: A file changed this recently (ctime, before its stat) is hashed but its digest is not kept in
#: the machine's cache: a rewrite within the same timestamp tick could leave its stat unchanged.
RACY_NS = 1_000_000_000
#: Seconds before a failed computation (a file unreadable) is tried again.
RETRY_S = 30.0
_SNAPSHOT_RE = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class IdentityPending(Exception):
    """The model's identity is not known yet: its weight files are being hashed for the first
    time on this machine. Treat it as a miss: look nothing up, store nothing under any name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(f"the identity of {path} is being computed (its weight files are hashed "
                         "once per machine); until then its chunks are misses and nothing is stored")
        self.path = str(path)


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


def _is_weight(name: str, size: int) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or size >= LARGE_FILE


def weight_stats(path: str | os.PathLike[str]) -> list[tuple[str, Path, os.stat_result]]:
    """``(relative name, file, stat)`` of every weight file under ``path`` (or the file itself),
    sorted by name: recursive, file symlinks followed, hidden entries (``.git``, ``.cache``) and
    directory symlinks skipped."""
    p = Path(path)
    if p.is_file():
        return [(p.name, p, p.stat())]
    out: list[tuple[str, Path, os.stat_result]] = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            f = Path(dirpath, name)
            try:
                st = f.stat()
            except OSError:  # a dangling symlink: not a weight file the engine can load
                continue
            if _is_weight(name, st.st_size) and not os.path.isdir(f):
                out.append((f.relative_to(p).as_posix(), f, st))
    out.sort(key=lambda t: t[0])
    return out


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files under a model directory (see :func:`weight_stats`), sorted by name."""
    return [f for _, f, _ in weight_stats(path)]


class WeightsJob:
    """One computation of a directory's ``files:<digest>`` (shared by every caller meanwhile)."""

    def __init__(self, root: str, stats: list[tuple[str, str, os.stat_result]], cache: DigestCache,
                 stat_time_ns: int) -> None:
        """``stats``: (name relative to the directory, real path, stat) of each weight file, taken
        at ``stat_time_ns`` (wall clock)."""
        self.root, self._stats, self._cache = root, stats, cache
        self._settled_ns = stat_time_ns - RACY_NS
        self._done = threading.Event()
        self._result: str | None = None
        self._error: BaseException | None = None
        self.started = time.monotonic()
        self.finished = 0.0

    def run(self) -> None:
        try:
            digests = {real: d for _, real, st in self._stats
                       if (d := self._cache.get(real, stat_key(st))) is not None}
            need = {real: st for _, real, st in self._stats if real not in digests}
            if need:
                fresh = hash_files({real: st.st_size for real, st in need.items()})
                # Not recorded: a file rewritten while it was read (its stat differs now), and one
                # changed less than RACY_NS before its stat (a write in the same clock tick, during
                # the hash, could leave its stat as it was: the "racily clean" files of git).
                self._cache.put_many({real: (stat_key(st), fresh[real]) for real, st in need.items()
                                      if st.st_ctime_ns < self._settled_ns
                                      and stat_key(os.stat(real)) == stat_key(st)})
                digests.update(fresh)
                log.info("model weights under %s hashed: %d files, %.1f GiB in %.2f s", self.root, len(need),
                         sum(st.st_size for st in need.values()) / 2**30, time.monotonic() - self.started)
            entries = ((rel, st.st_size, digests[real]) for rel, real, st in self._stats)
            self._result = "files:" + combine(entries)
        except BaseException as e:
            self._error = e
        finally:
            self.finished = time.monotonic()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the computation ended (done or failed); whether it did."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> str:
        """The digest (waiting up to ``timeout``); :class:`IdentityPending` when not done by then."""
        if not self._done.wait(timeout):
            raise IdentityPending(self.root)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


_jobs: dict[tuple[Any, ...], WeightsJob] = {}
_jobs_lock = threading.Lock()


def weights_job(path: str | os.PathLike[str], *, background: bool = True) -> WeightsJob | None:
    """The computation of ``path``'s ``files:`` digest: done at once when every file's stat is in
    the machine's cache; else started (``background``: in a daemon thread) or joined when one
    for the same files is running. None when ``path`` holds no weight file."""
    now = time.time_ns()
    stats = [(rel, os.path.realpath(f), st) for rel, f, st in weight_stats(path)]
    if not stats:
        return None
    root = str(Path(path).resolve())
    cache = default_cache()
    key = (root, cache.path, tuple((rel, stat_key(st)) for rel, _, st in stats))
    with _jobs_lock:
        job = _jobs.get(key)
        if job is not None and not (job.done() and job._error is not None
                                    and time.monotonic() - job.finished >= RETRY_S):
            return job  # running, done, or failed a moment ago (its error is the answer)
        job = _jobs[key] = WeightsJob(root, stats, cache, now)
        if len(_jobs) > 256:
            _jobs.pop(next(iter(_jobs)))
    if all(cache.get(real, stat_key(st)) is not None for _, real, st in stats) or not background:
        job.run()  # a restart: one stat per file, no byte read
    else:
        threading.Thread(target=job.run, name="kvbucket-identity-hash", daemon=True).start()
    return job


def files_fingerprint(path: str | os.PathLike[str], *, wait: bool = True) -> str | None:
    """``files:<digest>`` of the weight files under ``path`` (see the module docstring); None
    when there are none. ``wait=False``: :class:`IdentityPending` while it is being computed."""
    job = weights_job(path, background=not wait)
    if job is None:
        return None
    return job.result(None if wait else 0)


def weights_identity(path: str | os.PathLike[str] | None, config: Any = None,
                     revision: str | None = None, *, wait: bool = True) -> str:
    """The weights part of an identity: ``hub:<commit>``, else ``files:<digest>``, else
    ``revision:<text>`` (a revision the engine was given but did not resolve), else ``""``.
    ``wait=False``: :class:`IdentityPending` while the files' digest is being computed."""
    commit = hub_commit(path, config)
    if commit:
        return f"hub:{commit}"
    if revision and _COMMIT_RE.match(revision):
        return f"hub:{revision}"
    if path and Path(path).exists():
        fp = files_fingerprint(path, wait=wait)
        if fp:
            return fp
    return f"revision:{revision}" if revision else ""


__all__ = ["LARGE_FILE", "WEIGHT_SUFFIXES", "IdentityPending", "WeightsJob", "files_fingerprint",
           "hub_commit", "weight_files", "weight_stats", "weights_identity", "weights_job"]
