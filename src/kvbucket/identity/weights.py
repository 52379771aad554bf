"""The weights part of a model identity: a Hub commit, or a digest of every weight byte.

- A real Hub cache snapshot (``<cache>/models--org--name/snapshots/<commit>/``, its files symlinks
  into ``../../blobs/``: :func:`.files.hub_snapshot_commit`), or a config that carries
  ``_commit_hash`` (transformers sets it when it resolves a repo id) and was not loaded from a
  local directory: ``hub:<commit>``, free. (A file edited in place inside the Hub cache keeps the
  commit: a documented limit.)
- Local files: ``files:<digest>``, an XXH3-128 over every file of the model that counts
  (:func:`.files.model_file_stats`: every file under the directory, recursively, but a short
  list that cannot change the KV), of which at least one must be weights: its path relative to
  the directory, its size and the XXH3-128 of its *full content* (:mod:`.digest`). A fine-tune
  of one tensor anywhere changes it; a copy of the same files elsewhere, or a ``touch``, does not
  (mtimes and paths outside the directory are not in it). Each file's digest is kept in the
  machine's cache (:mod:`.local_cache`), so only the first computation on a machine reads the bytes.

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
from kvbucket.identity.files import (
    LARGE_FILE,
    WEIGHT_SUFFIXES,
    has_weights,
    hub_snapshot_commit,
    model_file_stats,
)
from kvbucket.identity.local_cache import DigestCache, default_cache, stat_key

log = logging.getLogger("kvbucket.identity")

#: A file changed this recently (ctime, before its stat) is hashed but its digest is not kept in
#: the machine's cache: a rewrite within the same timestamp tick could leave its stat unchanged.
RACY_NS = 1_000_000_000
#: Seconds before a failed computation (a file unreadable) is tried again.
RETRY_S = 30.0
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class IdentityPending(Exception):
    """The model's identity is not known yet: its weight files are being hashed for the first
    time on this machine. Treat it as a miss: look nothing up, store nothing under any name."""

    def __init__(self, path: str | os.PathLike[str], failed: BaseException | None = None) -> None:
        """``failed``: the last computation's error (a missing path, an unreadable file), which
        is tried again every :data:`RETRY_S` seconds: the message says that, not 'computing'."""
        if failed is None:
            what = "is being computed (its weight files are hashed once per machine)"
        else:
            what = f"is not known: {failed} (tried again every {RETRY_S:.0f} s)"
        super().__init__(f"the identity of {path} {what}; until then its chunks are misses and nothing "
                         "is stored")
        self.path = str(path)
        self.failed = failed


def hub_commit(path: str | os.PathLike[str] | None = None, config: Any = None) -> str | None:
    """The resolved Hub commit of a model: from a real Hub cache snapshot (``path``, else the
    config's ``_name_or_path`` when it is a local directory: :func:`.files.hub_snapshot_commit`),
    else the config's ``_commit_hash`` (transformers sets it when it resolves a repo id). None
    when neither says. A local directory that is not a real snapshot has no commit, whatever its
    path or config say (transformers takes any ``snapshots/<hex>/`` in a path as a commit)."""
    local = path
    if local is None:
        name = (config.get("_name_or_path") if isinstance(config, dict)
                else getattr(config, "_name_or_path", None))
        local = name if isinstance(name, str) and name and os.path.exists(name) else None
    if local is not None and os.path.exists(local):
        return hub_snapshot_commit(local)
    commit = config.get("_commit_hash") if isinstance(config, dict) else getattr(config, "_commit_hash", None)
    return commit if isinstance(commit, str) and _COMMIT_RE.match(commit) else None


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
            digests = self._cache.get_many({real: stat_key(st) for _, real, st in self._stats})
            need = {real: st for _, real, st in self._stats if real not in digests}
            if need:
                fresh = hash_files({real: st.st_size for real, st in need.items()})
                # Not recorded: a file rewritten while it was read (its stat differs now), and one
                # changed less than RACY_NS before its stat (a write in the same clock tick, during
                # the hash, could leave its stat as it was: the "racily clean" files of git).
                self._cache.put_many({real: (stat_key(st), fresh[real]) for real, st in need.items()
                                      if st.st_ctime_ns < self._settled_ns
                                      and stat_key(os.stat(real)) == stat_key(st)}, group=self.root)
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
    stats = model_file_stats(path)
    if not has_weights(stats):
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
    if len(cache.get_many({real: stat_key(st) for _, real, st in stats})) == len(stats) or not background:
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
           "hub_commit", "weights_identity", "weights_job"]
