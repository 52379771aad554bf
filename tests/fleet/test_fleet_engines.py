"""The engine tiers' fleet keys (SGLang HiCache, vLLM secondary tier) without the engines.

The tiers themselves need SGLang/vLLM (tests/engines run them, fleet included, in the engines'
venvs); here: their settings, the names the fleet counts, and two spawned processes joining one
directory's fleet the way the tiers do (kvbucket.testing.fleet_node.run_engine_node), one with
SGLang's page names and one with vLLM's chunk names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbucket.errors import ConfigError
from kvbucket.fleet.report import inspect_fleet
from kvbucket.integrations import engine_fleet, naming
from kvbucket.integrations.sglang import SGLangStorageSettings
from kvbucket.integrations.vllm import VLLMTierSettings
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.fleet_node import engine_name, run_engine_node, run_fleet

CHUNK = 2048
CAPACITY = 40 * CHUNK
FLEET = {"sync_secs": 0.2, "heartbeat_secs": 0.5, "node_timeout_secs": 3.0, "compact_secs": 1.0,
         "grace_secs": 0.8}  # hot-set hints reach the other node a round or two late (docs/fleet.md)


def test_settings_take_the_connectors_fleet_keys() -> None:
    keys = {"fleet": {"sync_secs": 2, "pinned_salts": ["gold"], "max_age_secs": 3600},
            "max_capacity_gb": 50, "eviction": {"trigger_watermark": 0.9, "eviction_ratio": 0.3}}
    s = SGLangStorageSettings.from_extra_config({"store_url": "/x", **keys})
    v = VLLMTierSettings.from_tier_config({"store_url": "/x", **keys})
    for got in (s, v):
        assert got.fleet is not None and got.fleet.pinned_salts == ("gold",)
        assert got.fleet.max_age_secs == 3600 and got.max_capacity_gb == 50
        assert got.eviction is not None and got.eviction.trigger_watermark == 0.9
    # As on LMCache's connector: a capacity or eviction without a fleet has nothing to count with.
    for bad in ({"max_capacity_gb": 1}, {"eviction": {}}):
        with pytest.raises(ConfigError, match="fleet"):
            SGLangStorageSettings.from_extra_config({"store_url": "/x", **bad})
        with pytest.raises(ConfigError, match="fleet"):
            VLLMTierSettings.from_tier_config({"store_url": "/x", **bad})
    with pytest.raises(ConfigError, match="sync_sec"):
        VLLMTierSettings.from_tier_config({"store_url": "/x", "fleet": {"sync_sec": 1}})


def test_the_fleet_counts_both_engines_names_by_their_salt_digest() -> None:
    gold = engine_fleet.chunk_salt(engine_name("sglang", 1, "gold"))
    assert gold == naming.salt_segment("gold", "sglang") and "gold" not in gold
    assert engine_fleet.chunk_salt(engine_name("vllm", 1, "gold")) == naming.salt_segment("gold", "vllm")
    assert engine_fleet.chunk_salt(engine_name("sglang", 1)) == ""
    assert engine_fleet.chunk_salt(engine_name("vllm", 1)) == ""
    for other in ("_fleet/j/node-a/3", "_fleet/d", "org%2Fm@00000001@00ff@salt", "sglang/m/nosalt/tp0of1",
                  "sglang/m/not-a-salt/tp0of1/layout/abc"):
        assert engine_fleet.chunk_salt(other) is None, other
    pins = engine_fleet.pinned_segments(["gold", ""])
    assert set(pins) == {"", naming.salt_segment("gold", "sglang"), naming.salt_segment("gold", "vllm")}


def test_an_sglang_and_a_vllm_process_writing_3x_capacity_settle_under_it(tmp_path: Path) -> None:
    """Two processes (one per engine's names) write 3x the shared capacity while the first reads
    a hot set; the second's first run has a pinned salt. The store settles at <= 1.1x capacity,
    the pinned and the hot chunks all survive, and both nodes evicted."""
    root = tmp_path / "kv"
    spec = {"root": str(root), "max_capacity_gb": CAPACITY / 1024**3}
    hot = list(range(4))
    settle = int(1.1 * CAPACITY)
    plans = [
        {"name": "sglang", "engine": "sglang", "writes": [["", 0, 60]], "hot": hot, "chunk": CHUNK,
         "batch": 4, "pause": 0.1, "settle_bytes": settle,
         "after": 1.0},
        {"name": "vllm", "engine": "vllm", "writes": [["gold", 1000, 8], ["", 2000, 52]], "chunk": CHUNK,
         "batch": 4, "pause": 0.1, "settle_bytes": settle,
         "after": 1.0},
    ]
    specs = [{**spec, "fleet": {**FLEET, "node_id": p["name"], "pinned_salts": ["gold"]}} for p in plans]
    reports = {r["node"]: r for r in run_fleet(specs, plans, timeout=90, target=run_engine_node)}
    with seal_store(FileStore(root), tier="sglang") as s:
        left = {i.name: i.size for i in s.list("") if not i.name.startswith("_fleet/")}
    assert sum(left.values()) <= 1.1 * CAPACITY, sum(left.values()) / CAPACITY
    assert all(engine_name("vllm", i, "gold") in left for i in range(1000, 1008))  # pinned
    assert all(engine_name("sglang", i) in left for i in hot)  # read all along
    a, b = reports["sglang"], reports["vllm"]
    assert a["stored"] + a["refused"] == 60 and b["stored"] + b["refused"] == 60
    assert a["refused"] + b["refused"] > 0  # the write cap held bursts back (failed stores)
    assert set(a["status"]["live_nodes"]) == {"sglang", "vllm"}
    evicted = [r["status"]["evicted_own"] + r["status"]["evicted_cross_node"] for r in (a, b)]
    assert sum(evicted) > 0, evicted
    assert a["gone"] > 0 and b["gone"] > 0  # and heard of what was deleted (the tiers forget it)
    assert a["hot_hits"] >= 4 * 15
    # What `kvbucket du` shows (the fleet's last digest and journals): both engines' chunks.
    du = inspect_fleet(FileStore(root))
    assert du is not None and set(du["bytes_by_cache_salt"]) == {"", naming.salt_segment("gold", "vllm")}
    assert du["bytes_by_cache_salt"][naming.salt_segment("gold", "vllm")] == 8 * CHUNK
