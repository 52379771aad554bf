"""kvbucket's own hf_xet sessions: one for uploads, one per read concurrency for downloads.

A session is process-wide (its runtime and connection pool are shared by every store of the
process) and is made again in a forked child, as huggingface_hub does with its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# hf_xet setting: ask the CAS server, for the first chunk of every uploaded object, whether
# another upload already stored it (global deduplication).
_GLOBAL_DEDUP = "deduplication.global_dedup_query_enabled"
_GLOBAL_DEDUP_ENV = "HF_XET_DEDUPLICATION_GLOBAL_DEDUP_QUERY_ENABLED"
# hf_xet setting: how uploaded chunks are compressed (auto: per chunk, byte grouping + LZ4 when it
# predicts a gain; none; lz4; bg4-lz4). HFBucketConfig.xet_compression; docs/hfbucket.md.
_COMPRESSION = "xorb.compression_policy"
_COMPRESSION_ENV = "HF_XET_XORB_COMPRESSION_POLICY"
COMPRESSIONS = ("auto", "none", "lz4", "bg4-lz4")
_upload_sessions: dict[tuple[int, str], Any] = {}  # (pid, compression) -> hf_xet.XetSession
_session_lock = threading.Lock()


def upload_session(compression: str = "auto") -> Any:
    """kvbucket's hf_xet session for uploads: huggingface_hub's, without global-dedup queries.

    Why: hf_xet asks the CAS server about the first chunk of every object it uploads, one
    request per object. A sealed chunk's first Xet chunk holds its envelope header, which holds
    the digest of the object's name, so that chunk can only be known if this very object was
    stored before (which the adapters' indexes already know): the query is a round trip per
    object that finds nothing. Chunks already in the local shard cache are deduplicated as
    before. ``HF_XET_DEDUPLICATION_GLOBAL_DEDUP_QUERY_ENABLED`` set in the environment wins.
    One session per ``compression`` (hf_xet's ``xorb.compression_policy``; its own
    ``HF_XET_XORB_COMPRESSION_POLICY`` in the environment wins, as hf_xet's variables do).
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"xet_compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    key = (os.getpid(), compression)
    with _session_lock:
        session = _upload_sessions.get(key)
        if session is None:
            from hf_xet import XetConfig, XetSession

            for k in [k for k in _upload_sessions if k[0] != key[0]]:
                del _upload_sessions[k]  # a parent's, in a forked child: not used here
            config = XetConfig()
            if _GLOBAL_DEDUP_ENV not in os.environ:
                config = config.with_config(_GLOBAL_DEDUP, False)
            if _COMPRESSION_ENV not in os.environ:
                config = config.with_config(_COMPRESSION, compression)
            session = _upload_sessions[key] = XetSession(config=config)
        return session


class UploadCommits:
    """A bucket client's hf_xet upload commits, each opened before the upload that takes it.

    Why: opening a commit sets up its CAS client (11 ms on an idle 2-core VM, 30-40 ms traced
    inside a 64 x 2 MiB store, with the sealing and ingestion of other work competing), and a
    store's upload waited for it before its first byte was ingested. After an upload takes its
    commit, the next is opened on a background thread, so every upload but a process's first
    starts ingesting at once. A commit opened ahead is used only in the process, for the Xet
    endpoint and token it was opened with, while that token has ``safety_secs`` left, and for at
    most ``max_idle_secs``; otherwise it is aborted (nothing was uploaded through it) and a new
    one opened. hf_xet renews a commit's token through the refresh URL either way. One commit
    is kept ahead per compression policy (xet_compression.batch_policy), so a process whose
    batches alternate between KV and ciphertext takes an open commit for either.
    """

    def __init__(self, refresh_url: str, headers: dict[str, str], *, safety_secs: float = 60.0,
                 max_idle_secs: float = 30.0, compression: str = "auto") -> None:
        self._refresh_url = refresh_url
        self._compression = compression
        self._headers = headers
        self._safety_secs = safety_secs
        self._max_idle_secs = max_idle_secs
        self._lock = threading.Lock()
        # policy -> (for whom, when, commit): the commit opened ahead for each compression policy
        self._spares: dict[str, tuple[tuple[int, str, str, int], float, Any]] = {}
        self._opening: set[str] = set()
        self._closed = False

    def _open(self, token: str, exp: int, cas_url: str, compression: str) -> Any:
        from huggingface_hub.utils._xet import xet_headers_without_auth

        return upload_session(compression).new_upload_commit(
            endpoint=cas_url, token=token, token_expiry_unix_secs=exp,
            token_refresh_url=self._refresh_url, token_refresh_headers=self._headers,
            custom_headers=xet_headers_without_auth(self._headers),
        )  # fmt: skip

    def take(self, token: str, exp: int, cas_url: str, safety_secs: float | None = None,
             compression: str | None = None) -> Any:
        """An open commit for these credentials and ``compression`` (default: the constructor's),
        the one opened ahead if it fits; the next is opened in the background while the token has
        more than ``safety_secs`` left (default: the constructor's; the client passes each
        token's own margin)."""
        policy = self._compression if compression is None else compression
        key = (os.getpid(), cas_url, token, exp)
        with self._lock:
            spare = self._spares.pop(policy, None)
        commit = None
        if spare is not None:
            if spare[0] == key and time.monotonic() - spare[1] <= self._max_idle_secs:
                commit = spare[2]
            elif spare[0][0] == key[0]:
                _abort(spare[2])  # stale: another token, or idle too long (a fork's is left alone)
        if commit is None:
            commit = self._open(token, exp, cas_url, policy)
        if exp - time.time() > (self._safety_secs if safety_secs is None else safety_secs):
            self._open_ahead(key, policy)
        return commit

    def _open_ahead(self, key: tuple[int, str, str, int], policy: str) -> None:
        with self._lock:
            if policy in self._opening or self._closed or policy in self._spares:
                return
            self._opening.add(policy)

        def run() -> None:
            commit = None
            try:
                commit = self._open(key[2], key[3], key[1], policy)
            except Exception:  # the next upload opens its own
                log.debug("opening an upload commit ahead failed", exc_info=True)
            with self._lock:
                self._opening.discard(policy)
                if commit is not None and not self._closed and policy not in self._spares:
                    self._spares[policy], commit = (key, time.monotonic(), commit), None
            if commit is not None:
                _abort(commit)

        threading.Thread(target=run, name="kvbucket-xet-commit", daemon=True).start()

    def close(self) -> None:
        """Abort the commits opened ahead, if any (no later one is opened)."""
        with self._lock:
            self._closed = True
            spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            if spare[0][0] == os.getpid():  # a fork's is left alone
                _abort(spare[2])


def _abort(commit: Any) -> None:
    try:
        commit.abort()
    except Exception:  # already finished or failed: nothing to stop
        log.debug("aborting an Xet upload commit failed", exc_info=True)


_download_sessions: dict[tuple[int, int], Any] = {}  # (pid, concurrency) -> hf_xet.XetSession
_download_users: dict[tuple[int, int], int] = {}  # (pid, concurrency) -> open clients holding it


def download_session(concurrency: int) -> Any:
    """An hf_xet session for reads whose fetch concurrency is fixed at ``concurrency``.

    Why not huggingface_hub's session: hf_xet adapts its download concurrency, starting at 4
    transfers, so a batch of 64 objects went out 4 at a time (a round trip per 4 objects at
    wide-area latency). ``HF_XET_FIXED_DOWNLOAD_CONCURRENCY`` would fix it for the whole
    process; a session of our own fixes it for kvbucket's reads only, and keeps as many
    connections warm between batches. Environment settings (``HF_XET_*``) still win.
    """
    pid = os.getpid()
    with _session_lock:
        session = _download_sessions.get((pid, concurrency))
        if session is None:
            from hf_xet import XetConfig, XetSession

            config = XetConfig()
            # Shared by every store of the process (and by reads a deadline abandoned that are
            # still winding down): room for several stores' full batches at once; each store
            # bounds its own loads with its thread pool (load_concurrency).
            room = max(256, 4 * concurrency)
            wanted = {
                "client.enable_adaptive_concurrency": False,
                "client.ac_initial_download_concurrency": room,
                "client.ac_max_download_concurrency": room,
                "client.max_idle_connections": max(concurrency, 16),
                "data.max_concurrent_file_downloads": room,
            }
            fixed = "HF_XET_FIXED_DOWNLOAD_CONCURRENCY" in os.environ  # hf_xet's own override
            for key, value in wanted.items():
                if fixed and "concurrency" in key:
                    continue
                if f"HF_XET_{key.replace('.', '_').upper()}" not in os.environ:
                    config = config.with_config(key, value)
            session = _download_sessions[(pid, concurrency)] = XetSession(config=config)
        return session


def hold_download_session(concurrency: int) -> Any:
    """:func:`download_session`, counted as held by one more open client until
    :func:`release_download_session`."""
    session = download_session(concurrency)
    key = (os.getpid(), concurrency)
    with _session_lock:
        _download_users[key] = _download_users.get(key, 0) + 1
    return session


def release_download_session(concurrency: int) -> None:
    """One client closed. The last one drops the session, so its runtime threads and pooled
    connections end with the stores that used them (hf_xet keeps them while the session lives;
    a download group still winding down keeps what it needs)."""
    key = (os.getpid(), concurrency)
    with _session_lock:
        left = _download_users.get(key, 0) - 1
        if left > 0:
            _download_users[key] = left
            return
        _download_users.pop(key, None)
        _download_sessions.pop(key, None)


__all__ = ["UploadCommits", "download_session", "hold_download_session", "release_download_session",
           "upload_session"]
