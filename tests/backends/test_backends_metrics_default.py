"""Library metrics on the documented path (issue 40 item 5): ``build_backend(load_engine_config(...))``
plus ``start_metrics_server`` exports the tier and store series with nothing wrapped by hand, and
``kvbucket stats`` (the console script) shows their rows; ``extra_config.metrics: false`` turns
them off. One label value per store, the same in every series: the store's URL (requests,
read-ahead, circuit breaker), never a token.

The user's program runs in a process of its own (a fresh registry, as a user's), on the Hub
emulator through the unmodified huggingface_hub/hf_xet: it stores two chunks, then a second
backend (an empty CPU tier) finds them in the bucket (a read-ahead) and reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbucket.testing.hub_fixtures import HubBucket

KVBUCKET = Path(sys.executable).with_name("kvbucket")

USER_PROGRAM = """
import sys
import numpy as np
from kvbucket.chunks import KVLayout
from kvbucket.config import build_backend, load_engine_config
from kvbucket.keys import CacheEngineKey
from kvbucket.metrics import start_metrics_server

layout = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=256)
keys = [CacheEngineKey("org/metrics-model", 1, 0, h, "bfloat16") for h in (101, 102)]
with build_backend(load_engine_config(sys.argv[1]), layout) as backend:
    assert backend.batched_put([(k, np.full(layout.full_chunk_bytes, i, dtype=np.uint8))
                                for i, k in enumerate(keys)]) == 2
    assert backend.batched_get(keys)[0] is not None
with build_backend(load_engine_config(sys.argv[1]), layout) as backend:  # an empty CPU tier
    assert backend.batched_contains(keys) == [True, True]  # remote hits: read-aheads start
    assert all(c is not None for c in backend.batched_get(keys))
    server = start_metrics_server(0)
    print(server.port, flush=True)
    sys.stdin.read()
"""

TIERS = {"local_cpu", "remote"}
STORE_SERIES = ("kvbucket_store_objects", "kvbucket_store_bytes", "kvbucket_store_latency_seconds",
                "kvbucket_read_ahead_bytes", "kvbucket_read_ahead_held_bytes", "kvbucket_store_breaker_state")


def run_program(config: Path, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The user's program: (its /metrics text, ``kvbucket stats --format json`` of it)."""
    proc = subprocess.Popen([sys.executable, "-c", USER_PROGRAM, str(config)], env={**os.environ, **env},
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read()
        url = f"http://127.0.0.1:{port}/metrics"
        text = httpx.get(url, timeout=10).text
        stats = subprocess.run([str(KVBUCKET), "stats", "--url", url, "--format", "json"],
                               capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0, stats.stderr
    finally:
        proc.communicate("", timeout=60)
    assert proc.returncode == 0
    return text, json.loads(stats.stdout)


def labels_of(text: str, prefix: str, label: str) -> set[str]:
    return {s.labels[label] for fam in text_string_to_metric_families(text) if fam.name.startswith(prefix)
            for s in fam.samples if label in s.labels}


@pytest.fixture
def hf_env(hub_bucket: HubBucket) -> dict[str, str]:
    return {"HF_ENDPOINT": hub_bucket.hub.endpoint, "HF_TOKEN": hub_bucket.hub.write_token}


def test_build_backend_exports_tier_and_store_series_by_default(
    hub_bucket: HubBucket, hf_env: dict[str, str], tmp_path: Path
) -> None:
    store_url = f"hf://buckets/{hub_bucket.bucket_id}/kv"
    config = tmp_path / "engine.yaml"
    config.write_text(f'chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.1\n'
                      f'remote_url: "{store_url}"\n')
    text, stats = run_program(config, hf_env)

    rows = {(r["kind"], r["name"]): r for r in stats["rows"]}
    assert {name for kind, name in rows if kind == "tier"} == TIERS, rows
    assert rows[("tier", "remote")]["hits"] >= 2 and rows[("tier", "remote")]["bytes_written"] > 0
    assert rows[("tier", "local_cpu")]["hits"] >= 1
    store = rows[("store", store_url)]
    assert store["writes"] == 2 and store["hits"] == 2 and store["bytes_read"] > 0
    assert [b["store"] for b in stats["breakers"]] == [store_url]
    # one label value for the store in every series that names it: its URL
    for series in STORE_SERIES:
        assert labels_of(text, series, "store") == {store_url}, series
    assert labels_of(text, "kvbucket_backend_", "tier") == TIERS
    assert hub_bucket.hub.write_token not in text

    off = tmp_path / "engine-off.yaml"
    off.write_text(config.read_text() + "extra_config:\n  metrics: false\n")
    text, stats = run_program(off, hf_env)
    assert not labels_of(text, "kvbucket_backend_", "tier")
    assert not labels_of(text, "kvbucket_store_objects", "store")
    assert not labels_of(text, "kvbucket_read_ahead_", "store"), "read-ahead series with metrics off"
    assert stats["rows"] == []


def test_the_metrics_setting_is_a_boolean() -> None:
    from kvbucket.config import EngineConfig
    from kvbucket.errors import ConfigError

    assert EngineConfig().metrics is True
    assert EngineConfig(extra_config={"metrics": False}).metrics is False
    with pytest.raises(ConfigError, match="metrics must be true or false"):
        EngineConfig.from_dict({"extra_config": {"metrics": "sometimes"}})
