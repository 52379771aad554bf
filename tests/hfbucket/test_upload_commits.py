"""Upload commits opened ahead (xet_sessions.UploadCommits), on the emulator with the real hf_xet.

A store's upload takes an hf_xet commit opened before it was needed, so it starts ingesting at
once; the tests count where commits are opened (the caller's thread or the background one), which
are aborted unused, and that what was stored reads back.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import numpy as np
import pytest

from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import sessions as xet_sessions
from kvbucket.testing.payloads import realistic_kv


class _Commit:
    def __init__(self, real: Any, log: dict[str, list[str]]) -> None:
        self.real, self.log = real, log

    def __enter__(self) -> _Commit:
        self.real.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.real.__exit__(*exc)

    def start_upload_bytes(self, *a: Any, **k: Any) -> Any:
        return self.real.start_upload_bytes(*a, **k)

    def start_upload_file(self, *a: Any, **k: Any) -> Any:  # objects from 1 MiB (xet_uploads)
        return self.real.start_upload_file(*a, **k)

    def abort(self) -> None:
        self.log["aborted"].append(threading.current_thread().name)
        self.real.abort()


class _Session:
    """hf_xet's upload sessions, recording on which thread each commit is opened, and for which
    compression policy."""

    def __init__(self) -> None:
        self.log: dict[str, list[str]] = {"opened": [], "aborted": [], "policy": []}
        self._real = xet_sessions.upload_session  # before the fixture replaces it

    def policy(self, compression: str = "auto") -> _Policy:
        return _Policy(self, self._real(compression), compression)


class _Policy:
    def __init__(self, session: _Session, real: Any, compression: str) -> None:
        self.session, self.real, self.compression = session, real, compression

    def new_upload_commit(self, **kwargs: Any) -> _Commit:
        with _log_lock:
            self.session.log["opened"].append(threading.current_thread().name)
            self.session.log["policy"].append(self.compression)
        return _Commit(self.real.new_upload_commit(**kwargs), self.session.log)


_log_lock = threading.Lock()


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> _Session:
    rec = _Session()
    monkeypatch.setattr(xet_sessions, "upload_session", rec.policy)
    return rec


def _store(hub_bucket: Any) -> HFBucketStore:
    hub = hub_bucket.hub
    handle = f"hf://buckets/{hub_bucket.bucket_id}/c-{uuid.uuid4().hex[:6]}"
    return HFBucketStore(build_config(bucket_handle=handle, token=hub.write_token, endpoint=hub.endpoint,
                                      token_env="", retry_backoff_secs=0.01))  # fmt: skip


def _spare_ready(store: HFBucketStore, policy: str = "none") -> None:
    commits = store._client._commits
    for _ in range(2000):  # the background open finishing; bounded, not timed
        with commits._lock:
            if policy in commits._spares:
                return
        threading.Event().wait(0.005)
    raise AssertionError(f"no commit was opened ahead for {policy}")


def _put_and_check(store: HFBucketStore, tag: str, n: int = 3, kv: bool = False) -> None:
    """Random bytes (a batch that goes up with ``none``: xet_compression), or bf16 KV (``auto``)."""
    rng = np.random.default_rng()
    make = (lambda i: realistic_kv(100_000, f"{tag}{i}-{uuid.uuid4()}")) if kv else (
        lambda _i: rng.integers(0, 256, 100_000, dtype=np.uint8))
    items = [(f"{tag}{i}", make(i)) for i in range(n)]
    assert all(r.ok for r in store.put_many(items))
    outs = [np.zeros_like(d) for _, d in items]
    assert all(r.found for r in store.get_many([k for k, _ in items], outs))
    assert all(np.array_equal(o, d) for o, (_, d) in zip(outs, items, strict=True))


AHEAD = "kvbucket-xet-commit"  # the thread that opens commits ahead


def _where(session: _Session) -> list[str]:
    return ["ahead" if t == AHEAD else "upload" for t in session.log["opened"]]


def test_an_upload_takes_the_commit_opened_ahead(hub_bucket: Any, session: _Session) -> None:
    with _store(hub_bucket) as store:
        _put_and_check(store, "a")
        _spare_ready(store)
        assert _where(session) == ["upload", "ahead"]  # a process's first upload opens its own
        _put_and_check(store, "b")
        _spare_ready(store)
        assert _where(session) == ["upload", "ahead", "ahead"]  # none opened by the upload itself
        assert session.log["aborted"] == []
    assert len(session.log["aborted"]) == 1  # closing the store aborts the unused one


def test_a_stale_commit_is_aborted_and_not_used(hub_bucket: Any, session: _Session) -> None:
    with _store(hub_bucket) as store:
        _put_and_check(store, "a")
        _spare_ready(store)
        store._client._commits._max_idle_secs = 0.0  # the spare has been idle too long
        _put_and_check(store, "b")
        assert len(session.log["aborted"]) == 1
        assert _where(session)[:3] == ["upload", "ahead", "upload"]
        _spare_ready(store)
        store._client._commits._max_idle_secs = 30.0
        tok, exp, cas = store._client._write_token.current  # type: ignore[misc]
        store._client._write_token.current = (tok, exp - 1, cas)  # as if renewed: the spare has the old one
        _put_and_check(store, "c")
        assert len(session.log["aborted"]) == 2  # opened with the old token: not used
        assert _where(session)[3:5] == ["ahead", "upload"]


def test_batches_of_each_compression_policy_take_their_own_commit_opened_ahead(
    hub_bucket: Any, session: _Session
) -> None:
    """Random bytes go up with ``none`` and KV with ``auto`` (xet_compression): a commit is kept
    ahead for each policy, so alternating batches open none on the upload's own thread once
    both are warm, and none is aborted until the store closes."""
    with _store(hub_bucket) as store:
        _put_and_check(store, "r")
        _spare_ready(store, "none")
        _put_and_check(store, "k", kv=True)
        _spare_ready(store, "auto")
        assert list(zip(_where(session), session.log["policy"], strict=True)) == [
            ("upload", "none"), ("ahead", "none"), ("upload", "auto"), ("ahead", "auto")]
        for tag, kv in (("r2", False), ("k2", True), ("r3", False)):
            _put_and_check(store, tag, kv=kv)
            _spare_ready(store, "auto" if kv else "none")
        assert _where(session)[4:] == ["ahead"] * 3  # each upload took the one kept for its policy
        assert session.log["policy"][4:] == ["none", "auto", "none"]
        assert session.log["aborted"] == []
    assert len(session.log["aborted"]) == 2  # closing the store aborts both unused ones
