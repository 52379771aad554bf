"""Through the real ``lmcache server`` (issue 40, outside tester F1 and F8).

F8: docs/l2.md says the adapter logs its default eviction (a capacity without an ``"eviction"``
setting) at start; LMCache's logging setup configures only its own loggers, so the line went to
Python's last-resort handler, which drops INFO, and never showed. F1: an adapter whose token
can read but not write reported ``is_healthy: true`` on ``/status`` after its stores failed.
One server, one adapter on the Hub emulator with a read-only token and a capacity."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from lmcache_server import Server

from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.lmcache_mp import BLOCK, MPEngine

pytestmark = pytest.mark.lmcache


def test_default_eviction_line_and_a_read_only_tokens_health_on_lmcache_server(
    hub_bucket: HubBucket, tmp_path: Path
) -> None:
    hub, bucket = hub_bucket.hub, hub_bucket.bucket_id
    params = {"type": "hfbucket", "bucket_handle": f"hf://buckets/{bucket}/kv", "token": hub.read_token,
              "endpoint": hub.endpoint, "max_capacity_gb": 0.001, "model_identity": "v3",
              "max_retries": 0}  # fmt: skip
    srv = Server([params], tmp_path / "server.log", env={"LMCACHE_DISABLE_BANNER": "1"})
    try:
        srv.wait_ready()
        out = re.sub(r"\x1b\[[0-9;]*m", "", srv.log.read_text())
        assert "without an eviction setting: evicting LRU" in out, out[-3000:]
        engine = MPEngine(f"tcp://127.0.0.1:{srv.port}", "org/ro-model", blocks=2)
        try:
            for r in range(3):
                engine.store(list(range(10_000 * (r + 1), 10_000 * (r + 1) + 2 * BLOCK)), [0, 1])
            deadline = time.monotonic() + 60
            while True:
                [a] = srv.adapters()
                if a["store_failures"] >= 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(1.0)  # the failed stores' HEADs (what landed?) answer meanwhile
            [a] = srv.adapters()
        finally:
            engine.close()
        assert a["store_failures"] >= 1 and a["keys"] == 0, a
        assert not a["is_healthy"] and a["last_error"], a
    finally:
        srv.stop()
