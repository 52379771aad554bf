"""Repeated identical failures are logged once with a count (kvbucket.log_once), in the tiers too."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np
import pytest

from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.keys import CacheEngineKey
from kvbucket.log_once import RepeatedLog, flush_all
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore

LAYOUT = KVLayout(2, 1, 8, "bfloat16", chunk_tokens=16)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def messages(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_identical_messages_are_counted_and_the_count_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rep = RepeatedLog(logging.getLogger("t.once"), window_s=60, clock=clock)
    caplog.set_level(logging.WARNING, "t.once")
    for i in range(300):
        rep.warning("get of %s from %s failed: %s", f"key-{i}", "hf://buckets/a/b", "bucket missing",
                    item=f"key-{i}")
    assert messages(caplog, "t.once") == ["get of key-0 from hf://buckets/a/b failed: bucket missing"]
    clock.t = 5
    rep.flush()
    assert messages(caplog, "t.once")[1:] == [
        "get of … from hf://buckets/a/b failed: bucket missing (repeated 299 more times in 5 s)"
    ]
    rep.warning("get of %s from %s failed: %s", "key-x", "hf://buckets/a/b", "bucket missing", item="key-x")
    assert messages(caplog, "t.once")[-1] == "get of key-x from hf://buckets/a/b failed: bucket missing"


def test_different_errors_are_each_logged_and_the_window_reports_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    rep = RepeatedLog(logging.getLogger("t.window"), window_s=10, clock=clock)
    caplog.set_level(logging.WARNING, "t.window")
    for err in ("timeout", "refused", "timeout", "timeout"):
        rep.warning("put failed: %s", err)
    assert messages(caplog, "t.window") == ["put failed: timeout", "put failed: refused"]
    clock.t = 11
    rep.warning("put failed: %s", "timeout")  # the window is over: the count so far is logged
    assert messages(caplog, "t.window")[-1] == "put failed: timeout (repeated 3 more times in 11 s)"
    rep.flush()
    assert len(messages(caplog, "t.window")) == 3  # nothing pending: flush adds no line


def test_explicit_identity_and_bounded_memory(caplog: pytest.LogCaptureFixture) -> None:
    rep = RepeatedLog(logging.getLogger("t.same"), max_kinds=2, clock=Clock())
    caplog.set_level(logging.WARNING, "t.same")
    for tid, n in ((1, 3), (2, 4), (3, 1)):
        rep.warning("store task %d: %d puts failed (%s)", tid, n, "503", same="store puts failed: 503")
    assert messages(caplog, "t.same") == ["store task 1: 3 puts failed (503)"]
    rep.warning("a"), rep.warning("a"), rep.warning("b")  # a third kind evicts the oldest, with its count
    assert "store puts failed: 503 (repeated 2 more times in 0 s)" in messages(caplog, "t.same")


def test_a_missing_bucket_is_one_line_per_kind_not_per_chunk(
    hub_emulator: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real tiers and the Hub emulator: 12 chunks into a bucket that does not exist."""
    monkeypatch.setenv("HF_TOKEN", hub_emulator.write_token)
    url = f"hf://buckets/{hub_emulator.namespace}/nope-{uuid.uuid4().hex[:8]}"
    store = HFBucketStore(HFBucketConfig(bucket_handle=url, endpoint=hub_emulator.endpoint, max_retries=0))
    flush_all()
    caplog.set_level(logging.WARNING, "kvbucket")
    keys = [CacheEngineKey("m", 1, 0, i, "bfloat16") for i in range(12)]
    chunk = np.zeros(LAYOUT.full_chunk_bytes, dtype=np.uint8)
    backend = HybridBackend([LocalCPUBackend(1 << 20), RemoteBackend(store, LAYOUT)])
    try:
        assert backend.batched_put([(k, chunk) for k in keys]) == 0  # nothing counted that did not land
        bufs = [np.empty(LAYOUT.full_chunk_bytes, dtype=np.uint8) for _ in keys]
        RemoteBackend(store, LAYOUT).batched_get_into(keys, bufs)
    finally:
        backend.close()  # flushes the counts
    lines = [r.getMessage() for r in caplog.records if "not found" in r.getMessage()]
    firsts = [ln for ln in lines if "repeated" not in ln]
    counts = [ln for ln in lines if "repeated" in ln]
    assert len(firsts) == 2, lines  # one per kind of failure (put, get), not one per chunk
    assert any("repeated 11 more times" in ln for ln in counts), lines
