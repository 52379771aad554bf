"""LMCache's non-MP connector (``KVBucketConnector``) over a hung store: its lookups
(``exists``, ``batched_contains``) and the lookup part of its reads answer "miss" within the
store's lookup deadline, never an exception, and at once once the store's breaker is open
(docs/reliability.md)."""

from __future__ import annotations

import statistics
import time

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey

from kvbucket.stores.guard.breaker import OPEN
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.lmcache_engine import MODEL, connector
from kvbucket.testing.silent_server import SilentServer

pytestmark = pytest.mark.lmcache


def test_connector_lookups_on_a_hung_store_miss_within_the_deadline_then_at_once() -> None:
    keys = [CacheEngineKey(MODEL, 1, 0, h, torch.bfloat16) for h in range(1, 40)]
    with SilentServer() as server:
        # Default lookup and load deadlines (1 s, 5 s); the breaker opens after 3 failed calls.
        store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b", token="hf_x", token_env="",
                                           endpoint=server.url, request_timeout_secs=1, breaker_failures=3,
                                           breaker_cooldown_secs=600))
        conn = connector(None, {"bucket_handle": "hf://buckets/o/b"}, store=store)
        try:
            t0 = time.monotonic()
            assert conn.exists_sync(keys[0]) is False  # was: DeadlineExceededError
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert conn.batched_contains(keys[1:3]) == 0
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert conn._batched_get_sync([keys[3]]) == [None]  # its lookup failed: no load after it
            assert time.monotonic() - t0 < 2.0  # the lookup deadline, not lookup + load (6 s)
            assert store.breaker.state is OPEN and conn.lookup_failures >= 4
            times = []
            for k in keys[4:]:
                t0 = time.perf_counter()
                assert conn.exists_sync(k) is False
                times.append(time.perf_counter() - t0)
            assert statistics.median(times) < 0.001  # the open breaker answers without the network
        finally:
            store.close()
            conn.store.close()
