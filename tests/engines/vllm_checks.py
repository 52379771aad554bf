"""Checks run INSIDE the vLLM venv (engines/venv.sh vllm) by tests/engines/test_vllm.py.

Everything vLLM here is vLLM's own released code: ``OffloadingSpecFactory`` creates the
``TieringOffloadingSpec`` from a ``kv_connector_extra_config``; its ``TieringOffloadingManager``
(CPU primary tier in vLLM's shared-memory region) loads ``KVBucketSecondaryTier`` by
``module_path`` through ``SecondaryTierFactory``; keys are vLLM's block hashes of real
``Request`` objects (``get_request_block_hasher``, with ``cache_salt``). The checks call the
manager as vLLM's ``OffloadingConnectorScheduler`` does (``kvbucket.testing.vllm_engine``) and
stand in only for the GPU worker's copy into and out of the CPU tier, which needs CUDA
(``test_the_gpu_worker_needs_cuda`` pins the error).
vLLM's own OffloadingConnector and the model identity are in vllm_connector_checks.py.
The stores come from $KVB_VLLM_TARGETS (JSON ``{name: {"url", "options"}}``), set by the outer
test, which owns the servers (Hub emulator, SeaweedFS).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    Medium,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm_common import BLOCK_BYTES, TARGETS, N, count_heads, engine, kv_data, offload_keys, store_target

from kvbucket.integrations.vllm import KVBucketSecondaryTier
from kvbucket.stores import open_store
from kvbucket.testing import vllm_engine
from kvbucket.testing.engines import fleet_target
from kvbucket.testing.vllm_engine import Engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


@pytest.fixture(params=sorted(TARGETS))
def target(request: pytest.FixtureRequest) -> dict[str, Any]:
    return store_target(request.param)


def test_store_then_load_after_a_restart(target: dict[str, Any]) -> None:
    a = engine(target)
    keys = offload_keys(1)
    kv = kv_data(a, 1)
    a.store(keys, kv)
    names = [a.tier.name(k) for k in keys]
    assert all(r.found for r in a.tier.store.head_many(names))
    a.close()
    b = engine(target)  # another engine (its own CPU region) on the same store: a restart
    assert b.tier.namespace == a.tier.namespace
    assert b.m.primary_tier.lookup(keys[0], b.ctx()) is LookupResult.MISS  # not in its CPU tier
    hits, got = b.load(keys)
    assert hits == N
    assert torch.equal(got, kv)
    stats = b.m.get_stats()  # vLLM's own tiering metrics saw the promotion from this tier
    assert stats is not None and not stats.is_empty()
    b.close()


def test_a_big_job_moves_every_chunk(target: dict[str, Any]) -> None:
    """40 chunks in one job (a directory store splits it over the tier's I/O threads)."""
    a = engine(target, cpu_chunks=48)
    keys = offload_keys(9, n=40)
    kv = kv_data(a, 9, n=40)
    a.store(keys, kv)
    a.close()
    b = engine(target, cpu_chunks=48)
    hits, got = b.load(keys)
    assert hits == 40 and torch.equal(got, kv)
    b.close()


def test_lookups_as_vllm_scans_a_prefix(target: dict[str, Any]) -> None:
    a = engine(target)
    keys = offload_keys(2)
    kv = kv_data(a, 2)
    stored = [0, 1, 2, 4]  # chunk 3 is a hole
    a.store([keys[i] for i in stored], kv[stored])
    a.close()
    b = engine(target)
    heads = count_heads(b.tier)
    ctx = b.ctx()
    with b.m.lock:
        b.m.on_new_request(ctx)
        first = b.m.lookup(keys[0], ctx)
    assert first is LookupResult.RETRY  # async: the answer comes from a batch after the step
    assert b.prefix_hits(keys, ctx) == 3
    assert heads[0] <= len(keys)  # one batched lookup per step, never a HEAD per call
    with b.m.lock:
        b.m.on_request_finished(ctx)
    b.settle()
    hits, got = b.load(keys)
    assert hits == 3 and torch.equal(got, kv[:3])
    # A chunk never stored is a miss; asked again right away (another request), it costs no I/O.
    other = offload_keys(3, n=2)
    assert b.load(other)[0] == 0
    before = heads[0]
    assert b.load(other)[0] == 0
    assert heads[0] == before
    b.close()


def test_index_lookups_answer_from_a_listing(target: dict[str, Any]) -> None:
    a = engine(target)
    keys = offload_keys(4)
    kv = kv_data(a, 4)
    a.store(keys, kv)
    a.close()
    b = engine(target, lookup="index")
    assert b.tier.lookup_mode == "index"
    assert b.tier.listed.wait(30)
    heads = count_heads(b.tier)
    hits, got = b.load(keys)
    assert hits == N and torch.equal(got, kv)
    assert b.load(offload_keys(5, n=3))[0] == 0
    assert heads[0] == 0  # found and missed without a single HEAD
    b.close()
    auto = engine(target)
    assert auto.tier.lookup_mode == ("index" if target["url"].startswith("s3://") else "head")
    auto.close()


def test_salts_and_parallel_layouts_are_isolated(target: dict[str, Any]) -> None:
    a = engine(target, salt="tenant-a")
    keys = offload_keys(6)
    a.store(keys, kv_data(a, 6))
    names = [o.name for o in a.tier.store.list(target["prefix"] + "/")]
    assert len(names) == N and not any("tenant-a" in n for n in names)
    a.close()
    for kw in ({"salt": "tenant-a"}, {"salt": "tenant-b"}, {}, {"salt": "tenant-a", "agnostic": False},
               {"salt": "tenant-a", "tp": 2, "agnostic": False}):
        e = engine(target, **kw)
        assert e.load(keys)[0] == (N if kw == {"salt": "tenant-a"} else 0), kw
        e.close()
    # vLLM puts a request's cache_salt into its block hashes: other keys, never a hit.
    salted = offload_keys(6, salt="request-salt")
    assert set(salted).isdisjoint(keys)
    e = engine(target, salt="tenant-a")
    assert e.load(salted)[0] == 0
    e.close()


def test_a_damaged_chunk_is_a_miss(target: dict[str, Any]) -> None:
    a = engine(target)
    keys = offload_keys(7, n=3)
    kv = kv_data(a, 7, n=3)
    a.store(keys, kv)
    name = a.tier.name(keys[1])
    bad = bytearray(a.tier._raw.get(name))
    bad[len(bad) // 2] ^= 0xFF
    a.tier._raw.put(name, bytes(bad))
    a.close()
    b = engine(target)
    # The lookup finds all three (a HEAD cannot see the damage); the load of chunk 1 fails its
    # check, vLLM frees its CPU slot, and the chunk is a miss from then on: never served.
    ctx = b.ctx()
    with b.m.lock:
        b.m.on_new_request(ctx)
    b.prefix_hits(keys, ctx)
    b.settle()
    assert b.prefix_hits(keys, ctx) == 1
    with b.m.lock:
        b.m.on_request_finished(ctx)
    hits, got = b.load(keys)
    assert hits == 1 and torch.equal(got[0], kv[0])
    b.close()


def test_a_chunk_this_engine_cannot_open_is_left_for_its_writer(target: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """An engine holding another tenant's key (same key id, so its lookups hit) misses on load,
    and removes nothing (docs/integrity.md, "What a reader may delete"): the writer still loads
    every chunk."""
    import base64

    rings = {}
    for who in ("writer", "other"):
        path = tmp_path / f"{who}.json"
        path.write_text(json.dumps({"tenants": {"*": {"1": base64.b64encode(os.urandom(32)).decode()}}}))
        rings[who] = {"keyring_file": str(path)}
    enc = rings["writer"]
    a = engine(target, encryption=enc)
    keys = offload_keys(8, n=3)
    kv = kv_data(a, 8, n=3)
    a.store(keys, kv)
    a.close()
    b = engine(target, encryption=rings["other"])
    hits, _ = b.load(keys)
    assert hits == 0
    names = [b.tier.name(k) for k in keys]
    assert all(r.found for r in b.tier._raw.head_many(names))  # still there
    b.close()
    c = engine(target, encryption=enc)
    hits, got = c.load(keys)
    assert hits == 3 and torch.equal(got, kv)
    c.close()


def test_the_documented_configs_load(target: dict[str, Any]) -> None:
    """docs/vllm.md's --kv-transfer-config examples, through vLLM's own config and factories;
    each tier entry (its store swapped for the test's) moves a chunk."""
    configs = re.findall(r"--kv-transfer-config '([^']*)'", DOC.read_text())
    assert len(configs) >= 3
    for raw in configs:
        cfg = KVTransferConfig(**json.loads(raw))
        assert cfg.kv_connector == "OffloadingConnector" and cfg.kv_role == "kv_both"
        extra = cfg.kv_connector_extra_config
        assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
        (entry,) = extra["secondary_tiers"]
        assert SecondaryTierFactory.get_tier_class(entry) is KVBucketSecondaryTier
        tier = {k: v for k, v in entry.items()
                if k not in ("type", "module_path", "store_url", "store_options", "metrics_port")}
        e = engine(target, **tier)
        keys = offload_keys(8, n=1)
        kv = kv_data(e, 8, n=1)
        e.store(keys, kv)
        e.close()
        e = engine(target, **tier)
        hits, got = e.load(keys)
        assert hits == 1 and torch.equal(got, kv), raw
        e.close()


def test_fleet_refuses_over_capacity_and_evicts(target: dict[str, Any]) -> None:
    """The fleet keys through vLLM's factory: chunks past the shared capacity fail their store job;
    eviction (down to 60%) deletes, and the tier forgets what it deleted; closing publishes the
    fleet's journal."""
    e, sub = fleet_engine(target)
    tier = e.tier
    jobs: list[Any] = []
    inner = tier.get_finished_jobs

    def finished() -> Any:
        out = list(inner())
        jobs.extend(out)
        return out

    tier.get_finished_jobs = finished  # type: ignore[method-assign]
    keys = offload_keys(12)
    e.store(keys, kv_data(e, 12))
    assert jobs and not all(j.success for j in jobs)  # the refused chunks failed their job
    names = [tier.name(k) for k in keys]
    assert sum(r.found for r in tier.store.head_many(names)) == 4
    assert tier._fleet.status()["refused_chunks"] == 2
    left = wait_evicted(tier, names)
    assert sum(left) == 2 and tier._fleet.status()["evicted_own"] == 2
    assert tier.known.state(keys) == [True if f else None for f in left]  # deleted: no longer known
    assert list(tier.take_events()) == []  # KV events off (the default): none
    e.close()
    with open_store(sub["url"], **sub.get("options", {})) as store:
        assert any(i.name.startswith("_fleet/") for i in store.list(""))


def test_fleet_deletions_emit_removed_events(target: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's KV events on, each chunk the fleet deletes that the tier reported stored is one
    removed event (medium STORAGE, vLLM's keys) from the manager's take_events(), as vLLM's CPU
    tier reports its evictions; refused chunks (never reported) and other namespaces' names get none."""
    real = vllm_engine.OffloadingConfig  # Engine turns vLLM's KV events off; this check needs them on
    monkeypatch.setattr(vllm_engine, "OffloadingConfig",
                        lambda **kw: real(**{**kw, "enable_kv_cache_events": True}))
    e, _ = fleet_engine(target, enable_kv_events=True)
    tier = e.tier
    assert tier.events is not None

    def tier_events() -> list[Any]:  # the primary (CPU) tier's own events have medium CPU
        return [ev for ev in e.m.take_events() if ev.medium == Medium.STORAGE]

    keys = offload_keys(13)
    e.store(keys, kv_data(e, 13))
    names = [tier.name(k) for k in keys]
    stored = [k for k, r in zip(keys, tier.store.head_many(names), strict=True) if r.found]
    assert len(stored) == 4  # two refused by the write cap
    left = wait_evicted(tier, names)
    gone = [k for k, f in zip(keys, left, strict=True) if k in stored and not f]
    assert len(gone) == 2
    events = tier_events()
    assert all(ev.locality == tier.locality for ev in events)
    assert sorted(k for ev in events if not ev.removed for k in ev.keys) == sorted(stored)
    removed = [k for ev in events if ev.removed for k in ev.keys]
    assert sorted(removed) == sorted(gone)  # each deleted chunk exactly once; refused ones never
    flags = [ev.removed for ev in events]
    assert flags == sorted(flags)  # every chunk reported stored before its removal
    kept = [n for n, f in zip(names, left, strict=True) if f]
    # the fleet repeating a deletion, refused chunks, and another namespace's chunk of the same
    # block hash as a kept one: no event
    other = f"other/ns/{kept[0].rpartition('/')[2]}"
    tier._gone([n for n, f in zip(names, left, strict=True) if not f] + [other])
    assert tier_events() == []
    e.close()


def fleet_engine(target: dict[str, Any], **tier: Any) -> tuple[Engine, dict[str, Any]]:
    """An engine in a fleet of its own (a fresh sub-store), capacity 4 chunks, write cap 1.0 (the
    5th chunk is refused; main's default cap is 2.0); returns it and its target."""
    sub = fleet_target(target)  # a fleet of its own
    fleet = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 3.0, "grace_secs": 1.0,
             "write_cap": 1.0}
    e = engine(sub, fleet=fleet, max_capacity_gb=4 * BLOCK_BYTES / 1024**3, **tier)
    assert e.tier.block_size_bytes == BLOCK_BYTES
    assert e.tier._fleet is not None and e.tier._fleet.fleet.wait_ready(30)
    return e, sub


def wait_evicted(tier: KVBucketSecondaryTier, names: list[str]) -> list[bool]:
    """Wait until eviction (down to 60% of 4 chunks) deleted; returns which names are still stored."""
    deadline = time.monotonic() + 30
    while tier._fleet.status()["bytes_used"] > 2.4 * tier.block_size_bytes:
        assert time.monotonic() < deadline, tier._fleet.status()
        time.sleep(0.05)
    return [r.found for r in tier.store.head_many(names)]


def test_the_gpu_worker_needs_cuda(target: dict[str, Any]) -> None:
    """How far the GPU side runs here: vLLM's CPU worker (GPU <-> CPU tier copies) refuses CPU
    tensors; docs/vllm.md quotes these errors."""
    e = engine(target)
    gpu = CanonicalKVCacheTensor(torch.zeros(8, BLOCK_BYTES, dtype=torch.int8), BLOCK_BYTES)  # on the CPU
    kv = CanonicalKVCaches(tensors=[gpu], group_data_refs=[[CanonicalKVCacheRef(0, BLOCK_BYTES)]])
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU GPUs"):
        e.spec.get_worker(kv)
    with pytest.raises(AssertionError) as err:
        e.spec.create_worker(kv)
    assert "gpu_tensor.is_cuda" in str(err.traceback[-1].statement)
    e.close()


def _tier_metric(name: str, labels: dict[str, str]) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _tier_gets(store: str) -> float:
    return sum(_tier_metric("kvbucket_store_objects_total", {"store": store, "op": "get", "result": r})
               for r in ("hit", "miss", "error"))


def test_a_lookup_hit_reads_ahead_for_the_load_job(target: dict[str, Any]) -> None:
    """The tier's lookup hit starts the chunks' load; the promotion job vLLM submits next takes
    them from the read-ahead: every chunk read from the store once, and the bytes counted used."""
    a = engine(target)
    keys = offload_keys(21)
    kv = kv_data(a, 21)
    a.store(keys, kv)
    url = a.tier._raw.url  # the store's label in every series (requests, read-ahead, breaker)
    a.close()
    used = _tier_metric("kvbucket_read_ahead_bytes_total", {"store": url, "outcome": "used"})
    gets = _tier_gets(url)
    b = engine(target)
    hits, got = b.load(keys)
    assert hits == N and torch.equal(got, kv)
    assert _tier_gets(url) - gets == N  # read once (by the read-ahead), not again by the load job
    assert _tier_metric("kvbucket_read_ahead_bytes_total",
                        {"store": url, "outcome": "used"}) - used == N * b.tier.block_size_bytes
    b.close()
    off = engine(target, read_ahead=False)
    used = _tier_metric("kvbucket_read_ahead_bytes_total", {"store": url, "outcome": "used"})
    hits, got = off.load(keys)
    assert hits == N and torch.equal(got, kv)
    assert _tier_metric("kvbucket_read_ahead_bytes_total", {"store": url, "outcome": "used"}) == used
    off.close()


def test_metrics_port_serves_once_per_process_and_a_taken_port_says_so(target: dict[str, Any]) -> None:
    """``metrics_port``: the tier serves kvbucket's metrics (its store's requests among them) on
    loopback; a second tier of the process shares the endpoint; a port another socket holds stops
    the tier with an error naming the key and the fix (not a bare OSError)."""
    import socket
    import urllib.request

    from kvbucket.errors import ConfigError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    a = engine(target, metrics_port=port)
    keys = offload_keys(31, n=1)
    a.store(keys, kv_data(a, 31, n=1))
    b = engine(target, metrics_port=port)  # the same process and port: shared, no error
    assert b.tier.metrics is a.tier.metrics
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    puts = [ln for ln in body.splitlines() if ln.startswith("kvbucket_store_objects_total{")
            and all(lab in ln for lab in (f'store="{a.tier._raw.url}"', 'op="put"', 'result="ok"'))]
    assert len(puts) == 1 and float(puts[0].split()[-1]) >= 1
    a.close()
    b.close()
    with socket.socket() as held:  # another process's port, as the kernel reports it
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{held.getsockname()[1]} \(metrics_port\): "
                                              r"the port is in use by another process; set metrics_port"):
            engine(target, metrics_port=held.getsockname()[1])

