"""The storage backends' fleet keys (``build_backend`` from an engine YAML): validation, and what a
remote tier in a fleet does in one process: refused stores are failed puts, deletes anywhere are
forgotten, ``max_age_secs`` and pins hold, ``close()`` publishes, status and ``kvbucket du``.

The multi-process runs (fs, S3, Hub emulator) are in test_fleet_backends_processes.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbucket.backends.fleet import FleetWriteCapError, chunk_salt
from kvbucket.backends.hybrid import HybridBackend, TierPutError
from kvbucket.backends.plugins import PLUGIN_TYPES, remote_tier_specs
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig, build_backend, load_engine_config
from kvbucket.errors import ConfigError
from kvbucket.fleet.report import inspect_fleet
from kvbucket.keys import key_to_name
from kvbucket.metrics import uninstrumented
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.fleet_backend_node import LAYOUT, backend_chunk, backend_key, chunk_bytes
from kvbucket.testing.fleet_node import until

LAYOUT_ = KVLayout(**LAYOUT)
CHUNK = LAYOUT_.full_chunk_bytes
FAST = {"sync_secs": 0.2, "heartbeat_secs": 0.5, "node_timeout_secs": 5.0, "compact_secs": 1.0,
        "grace_secs": 0.3}


def engine_yaml(root: Path, node: str, **extra: Any) -> dict[str, Any]:
    return {"chunk_size": LAYOUT["chunk_tokens"], "local_cpu": True, "max_local_cpu_size": 0.01,
            "remote_url": f"file://{root}",
            "extra_config": {"max_capacity_gb": 64 * CHUNK / 1024**3,
                             "fleet": {**FAST, "node_id": node}, **extra}}


def build(data: dict[str, Any]) -> HybridBackend:
    backend = build_backend(EngineConfig.from_dict(data), LAYOUT_)
    assert isinstance(backend, HybridBackend)
    return backend


def remote(backend: HybridBackend) -> RemoteBackend:
    tier = uninstrumented(backend.tiers[-1])
    assert isinstance(tier, RemoteBackend)
    return tier




# ---- configuration ---------------------------------------------------------------------------------
PLUGIN_YAML = """
chunk_size: 32
local_cpu: false
remote_storage_plugins: ["hfbucket.us"]
extra_config:
  remote_storage_plugin.hfbucket.us.bucket_handle: "hf://buckets/my-org/lmcache-kv/prod"
  remote_storage_plugin.hfbucket.us.max_capacity_gb: 500
  remote_storage_plugin.hfbucket.us.eviction: {trigger_watermark: 0.9, eviction_ratio: 0.1}
  remote_storage_plugin.hfbucket.us.fleet: {sync_secs: 5, grace_secs: 10, pinned_salts: ["system-prompts"]}
"""


def test_plugin_and_remote_url_tiers_take_the_connectors_fleet_keys(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(PLUGIN_YAML)
    (spec,) = remote_tier_specs(load_engine_config(path, env={}))
    assert spec.label == "hfbucket.us" and spec.options == {"bucket_handle": "hf://buckets/my-org/lmcache-kv/prod"}
    assert spec.fleet is not None and spec.fleet.max_capacity_gb == 500
    assert spec.fleet.fleet is not None and spec.fleet.fleet.pinned_salts == ("system-prompts",)
    assert spec.fleet.eviction is not None and spec.fleet.eviction.trigger_watermark == 0.9
    # The remote_url store's options are plain extra_config keys: so are its fleet keys.
    cfg = EngineConfig.from_dict(engine_yaml(tmp_path, "a", fsync=False))
    (spec,) = remote_tier_specs(cfg)
    assert spec.options == {"fsync": False} and spec.fleet is not None and spec.fleet.fleet is not None
    # LMCache's non-MP connector reads the very same keys (one YAML for both paths).
    pytest.importorskip("lmcache")
    from kvbucket.integrations.lmcache import connector_config_from_extra

    extra = yaml.safe_load(PLUGIN_YAML)["extra_config"]
    extra["remote_storage_plugin.hfbucket.us.metadata_cache_ttl_secs"] = 30
    conn = connector_config_from_extra(extra, "hfbucket.us")
    assert conn.fleet == spec_fleet(PLUGIN_YAML) and conn.max_capacity_gb == 500
    assert conn.eviction is not None and conn.eviction.trigger_watermark == 0.9


def spec_fleet(text: str) -> Any:
    (spec,) = remote_tier_specs(EngineConfig.from_dict(yaml.safe_load(text)))
    return spec.fleet.fleet if spec.fleet is not None else None


@pytest.mark.parametrize(("keys", "named", "fix"), [
    ({"max_capacity_gb": 1}, "extra_config.remote_storage_plugin.hfbucket.us.max_capacity_gb",
     "Add remote_storage_plugin.hfbucket.us.fleet: {}"),
    ({"eviction": {"trigger_watermark": 0.9}}, "extra_config.remote_storage_plugin.hfbucket.us.eviction",
     "Add remote_storage_plugin.hfbucket.us.fleet: {}"),
    ({"fleet": {"sync_secs": -1}}, "'remote_storage_plugin.hfbucket.us.fleet.sync_secs'", "greater than 0"),
    ({"fleet": {"sync_sec": 1}}, "'remote_storage_plugin.hfbucket.us.fleet.sync_sec'", "unknown setting"),
    ({"fleet": {}, "max_capacity_gb": -2}, "'remote_storage_plugin.hfbucket.us.max_capacity_gb'",
     "greater than or equal to 0"),
    ({"fleet": {}, "eviction": {"trigger_watermark": 2}},
     "'remote_storage_plugin.hfbucket.us.eviction.trigger_watermark'", "less than or equal to 1"),
    ({"fleet": {}, "eviction": {"trigger_watermark": 0.5, "eviction_ratio": 0.7}},
     "'remote_storage_plugin.hfbucket.us.eviction'", "must not exceed trigger_watermark"),
    ({"fleet": "yes"}, "extra_config.remote_storage_plugin.hfbucket.us.fleet", "must be a mapping"),
    ({"fleet": {"node_id": "a/b"}}, "'remote_storage_plugin.hfbucket.us.fleet.node_id'", "letters, digits"),
])
def test_bad_fleet_settings_name_the_key_and_the_fix_before_any_store_opens(
        keys: dict[str, Any], named: str, fix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    monkeypatch.setitem(PLUGIN_TYPES, "hfbucket", lambda name, options, engine: opened.append(name))
    extra = {"remote_storage_plugin.hfbucket.us.bucket_handle": "hf://buckets/o/b"}
    extra.update({f"remote_storage_plugin.hfbucket.us.{k}": v for k, v in keys.items()})
    cfg = EngineConfig.from_dict({"chunk_size": 32, "local_cpu": False,
                                  "remote_storage_plugins": ["hfbucket.us"], "extra_config": extra})
    with pytest.raises(ConfigError) as e:
        build_backend(cfg, LAYOUT_)
    assert named in str(e.value) and fix in str(e.value), str(e.value)
    assert opened == []  # nothing was opened (no request, no fleet thread)


def test_a_remote_url_capacity_without_fleet_is_refused(tmp_path: Path) -> None:
    data = engine_yaml(tmp_path, "a")
    del data["extra_config"]["fleet"]
    with pytest.raises(ConfigError, match=r"extra_config.max_capacity_gb need extra_config.fleet.*fleet: \{"):
        build_backend(EngineConfig.from_dict(data), LAYOUT_)


def test_the_builder_is_not_imported_by_the_config_module() -> None:
    """Importing kvbucket.config imports no backend (the backends read kvbucket.engine_config);
    the builder is handed out lazily for ``from kvbucket.config import build_backend``."""
    code = ("import sys, kvbucket.config as c; "
            "assert not [m for m in sys.modules if m.startswith('kvbucket.backends')], sorted(sys.modules); "
            "from kvbucket.config import build_backend; "
            "from kvbucket.backends.build import build_backend as b; assert build_backend is b")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- behaviour --------------------------------------------------------------------------------------
def test_a_store_past_the_write_cap_fails_and_is_not_counted(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    data = engine_yaml(root, "a")
    data["extra_config"]["max_capacity_gb"] = 8 * CHUNK / 1024**3
    data["extra_config"]["fleet"]["write_cap"] = 1.0  # refuse past the capacity (the default is 2.0)
    with build(data) as backend:
        assert remote(backend)._fleet is not None and remote(backend)._fleet.fleet.wait_ready(10)
        items = [(backend_key(i), backend_chunk(i, CHUNK)) for i in range(12)]
        results = backend.batched_put_results(items)
        refused = [r for r in results if r is not None]
        assert len(refused) == 4
        assert all(isinstance(r, TierPutError) and "write cap" in str(r) for r in refused)
        assert results[:8] == [None] * 8  # in order: the first chunks fit
        status = backend.report_status()["fleet"]
        assert status["refused_chunks"] == 4 and status["bytes_used"] == 8 * CHUNK
        names = set(chunk_bytes(remote(backend)))
        assert names == {key_to_name(backend_key(i)) for i in range(8)}  # the refused never landed
        # A remote tier on its own reports the fleet's own error type.
        (err,) = remote(backend).batched_put_results([(backend_key(99), backend_chunk(99, CHUNK))])
        assert isinstance(err, FleetWriteCapError)
        assert backend.batched_put([(backend_key(100), backend_chunk(100, CHUNK))]) == 0


def test_a_chunk_deleted_by_another_node_is_forgotten(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with build(engine_yaml(root, "a")) as a, build(engine_yaml(root, "b")) as b:
        k = backend_key(7)
        a.put(k, backend_chunk(7, CHUNK))
        assert until(lambda: remote(b).report_status()["fleet"]["chunks"] == 1, 15.0)
        assert remote(b).contains(k)  # b's size cache now holds it (30 s TTL)
        assert a.remove(k)
        # b hears of the delete through the fleet and drops it from its cache, so contains asks
        # the store again instead of answering a stale hit for 30 s.
        assert until(lambda: remote(b).report_status()["fleet"]["remote_deletes_seen"] >= 1, 15.0)
        assert not remote(b).contains(k)


def test_max_age_and_pins_hold_across_nodes(tmp_path: Path) -> None:
    """Node a writes and leaves; node b (same settings) evicts a's chunks older than
    max_age_secs, except those of a pinned salt."""
    root = tmp_path / "kv"
    fleet = {**FAST, "max_age_secs": 1.5, "pinned_salts": ["gold"]}
    with build({**engine_yaml(root, "a"), "extra_config": {"fleet": {**fleet, "node_id": "a"}}}) as a:
        for i in range(4):
            a.put(backend_key(i), backend_chunk(i, CHUNK))
        a.put(backend_key(50, "gold"), backend_chunk(50, CHUNK))
    with build({**engine_yaml(root, "b"), "extra_config": {"fleet": {**fleet, "node_id": "b"}}}) as b:
        assert until(lambda: set(chunk_bytes(remote(b))) == {key_to_name(backend_key(50, "gold"))}, 20)
        status = b.report_status()["fleet"]
        assert status["evicted_cross_node"] == 4 and status["bytes_by_cache_salt"] == {"gold": CHUNK}


def test_close_publishes_and_du_counts_backend_chunks_by_salt(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with build(engine_yaml(root, "a")) as a:
        a.batched_put([(backend_key(i, "tenant-a"), backend_chunk(i, CHUNK)) for i in range(3)])
        a.put(backend_key(9), backend_chunk(9, CHUNK))
        status = a.report_status()
        assert status["fleet"]["bytes_used"] == 4 * CHUNK and status["tiers"][-1]["fleet"] is status["fleet"]
    # closed at once after the stores: its last journal is what kvbucket du reads
    du = inspect_fleet(FileStore(root))
    assert du is not None and du["chunks"] == 4
    assert du["bytes_by_cache_salt"] == {"tenant-a": 3 * CHUNK, "": CHUNK}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "kvbucket", "du", str(root)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"fleet index: 4 chunks, {4 * CHUNK} bytes" in proc.stdout
    assert f"  salt 'tenant-a': {3 * CHUNK} bytes" in proc.stdout


def test_reads_served_by_the_cpu_tier_reach_the_fleet_as_access_hints(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with build(engine_yaml(root, "a")) as a:
        k = backend_key(3)
        a.put(k, backend_chunk(3, CHUNK))
        fleet = remote(a)._fleet
        assert fleet is not None
        name = key_to_name(k)
        before = fleet.fleet._state.view.entries[name].accessed
        time.sleep(0.05)
        assert a.get(k) is not None and a.hits[0] == 1  # from memory: the remote was not asked
        assert fleet.fleet._state.view.entries[name].accessed > before


def test_chunk_salt_reads_the_cache_salt_tag() -> None:
    assert chunk_salt(key_to_name(backend_key(1, "tenant"))) == "tenant"
    assert chunk_salt(key_to_name(backend_key(1))) == ""
    assert chunk_salt("p/" + key_to_name(backend_key(1, "t")), "p") == "t"
    for other in ("_fleet/d", "_fleet/j/a/000000000001", "not-a-key", "org%2Fm@00000001@00ff"):
        assert chunk_salt(other) is None, other


def test_the_docs_fleet_yamls_are_engine_configs_with_a_fleet() -> None:
    """The copy-paste YAMLs of docs/backends.md and docs/fleet.md build a fleet-bound remote tier."""
    root = Path(__file__).resolve().parents[2] / "docs"
    blocks = []
    for doc in ("backends.md", "fleet.md"):
        for m in re.finditer(r"^( *)```yaml\n(.*?)^\1```", (root / doc).read_text(), re.M | re.S):
            text = textwrap.dedent(m.group(2))
            if "fleet" in text.splitlines()[0]:  # the blocks whose first comment says so
                blocks.append((doc, text))
    assert [d for d, _ in blocks] == ["backends.md", "backends.md", "fleet.md"], blocks
    for doc, text in blocks:
        specs = remote_tier_specs(EngineConfig.from_dict(yaml.safe_load(text)))
        assert len(specs) == 1 and specs[0].fleet is not None, doc
        settings = specs[0].fleet
        assert settings.fleet is not None and settings.max_capacity_gb == 500, doc
        assert not set(specs[0].options) & {"fleet", "max_capacity_gb", "eviction"}, doc


def test_kvbucket_stats_shows_the_fleet_usage_of_a_running_process(tmp_path: Path) -> None:
    from kvbucket.metrics import start_metrics_server

    root = tmp_path / "kv"
    with build(engine_yaml(root, "stats-node")) as a:
        a.batched_put([(backend_key(i), backend_chunk(i, CHUNK)) for i in range(2)])
        url = remote(a).store.url
        with start_metrics_server(0) as server:
            out = subprocess.run([sys.executable, "-m", "kvbucket", "stats", "--url", server.url],
                                 capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    line = f"fleet on {url} (node stats-node): 64.0 KiB of 2.0 MiB (3%) in 2 chunks, 1 live nodes"
    assert line in out.stdout, out.stdout


def test_fleet_config_errors_name_the_settings_not_a_docs_file() -> None:
    """A wheel user has no docs/ (issue 40 item 8): an unknown fleet setting names the ones it takes,
    and no fleet error points to docs/fleet.md."""
    from kvbucket.backends.fleet import parse_fleet_settings

    for keys in ({"fleet": {"sync_sec": 1}}, {"max_capacity_gb": 1}, {"fleet": 3},
                 {"fleet": {}, "eviction": {"policy": "LRU"}}):
        with pytest.raises(ConfigError) as e:
            parse_fleet_settings(keys, "")
        assert "docs/" not in str(e.value), e.value
    with pytest.raises(ConfigError, match=r"unknown setting; it takes .*sync_secs"):
        parse_fleet_settings({"fleet": {"sync_sec": 1}}, "")
    with pytest.raises(ConfigError, match="it takes eviction_policy, eviction_ratio, trigger_watermark"):
        parse_fleet_settings({"fleet": {}, "eviction": {"policy": "LRU"}}, "")
