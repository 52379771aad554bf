"""Checks run INSIDE the SGLang venv (engines/venv.sh sglang) by tests/engines/test_sglang.py.

Everything SGLang here is SGLang's own released code: ``StorageBackendFactory`` with the
``dynamic`` backend, ``HiCacheStorageConfig``, a device ``MHATokenToKVPool`` and its
``MHATokenToKVPoolHost`` on the CPU, and SGLang's page hashes (``get_storage_hash_str``).
The stores to run on come from $KVB_SGLANG_TARGETS (JSON ``{name: {"url", "options"}}``), set by
the outer test, which owns the servers (Hub emulator, SeaweedFS).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from array import array
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvbucket.integrations.sglang import KVBucketHiCacheStorage
from kvbucket.testing.engines import fleet_target, target_listing

TARGETS: dict[str, dict[str, Any]] = json.loads(os.environ.get("KVB_SGLANG_TARGETS", "{}"))
PAGE = 16
LAYERS, HEADS, DIM = 3, 2, 8
N_PAGES = 6


@pytest.fixture(params=sorted(TARGETS))
def target(request: pytest.FixtureRequest) -> dict[str, Any]:
    t = dict(TARGETS[request.param])
    t["name"] = request.param
    # Each test gets its own namespace in the shared bucket/directory.
    t["prefix"] = f"sglang-{uuid.uuid4().hex[:12]}"
    return t


def device_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(size=512, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)


_DEVICE = None


def host_pool(layout: str = "layer_first") -> MHATokenToKVPoolHost:
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = device_pool()
    return MHATokenToKVPoolHost(_DEVICE._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0,
                                page_size=PAGE, layout=layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=512, start_layer=0, end_layer=LAYERS)


def config(target: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
           salt: str = "", model: str = "org/Model-7B", **more: Any) -> HiCacheStorageConfig:
    extra = {
        "backend_name": "kvbucket", "module_path": "kvbucket.integrations.sglang",
        "class_name": "KVBucketHiCacheStorage", "interface_v1": 1,
        "store_url": target["url"], "store_options": target.get("options", {}),
        "prefix": target["prefix"], **more,
    }
    if salt:
        extra["cache_salt"] = salt
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model, extra_config=extra)


def backend(target: dict[str, Any], pool: MHATokenToKVPoolHost, **kw: Any) -> KVBucketHiCacheStorage:
    """Created exactly as SGLang's cache controller does: factory, then register_mem_pool_host."""
    b = StorageBackendFactory.create_backend("dynamic", config(target, **kw), pool)
    assert isinstance(b, KVBucketHiCacheStorage)
    b.register_mem_pool_host(pool)
    return b


def fill(pool: MHATokenToKVPoolHost, n_pages: int, seed: int) -> torch.Tensor:
    """Allocate pages in the host pool and write random KV into them; returns the token indices."""
    idx = pool.alloc(n_pages * PAGE)
    g = torch.Generator().manual_seed(seed)
    for p in range(n_pages):
        page = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=g).to(pool.dtype)
        pool.set_from_flat_data_page(int(idx[p * PAGE]), page)
    return idx


def page_bytes(pool: MHATokenToKVPoolHost, idx: torch.Tensor, n_pages: int) -> list[bytes]:
    return [pool.get_data_page(int(idx[p * PAGE]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for p in range(n_pages)]


def page_keys(seed: int, n_pages: int = N_PAGES, salt: str | None = None) -> list[str]:
    """SGLang's own page hashes of a token sequence (its per-request salt seeds the chain)."""
    tokens = array("q", [(seed * 7919 + i) % 32000 for i in range(n_pages * PAGE)])
    keys = get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=PAGE)
    assert len(keys) == n_pages
    return keys


def test_store_then_load_into_another_host_pool(target: dict[str, Any]) -> None:
    src = host_pool()
    idx = fill(src, N_PAGES, seed=1)
    keys = page_keys(1)
    b = backend(target, src)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, idx) == [True] * N_PAGES

    dst = host_pool()
    dst.alloc(5 * PAGE)  # other slots than the source used
    idx2 = dst.alloc(N_PAGES * PAGE)
    assert not torch.equal(idx, idx2)
    r = backend(target, dst)
    assert r.batch_get_v1(keys, idx2) == [True] * N_PAGES
    assert page_bytes(dst, idx2, N_PAGES) == page_bytes(src, idx, N_PAGES)
    stats = r.get_stats()
    assert isinstance(stats, StorageMetrics) and sum(stats.prefetch_pgs) == N_PAGES
    assert sum(b.get_stats().backup_pgs) == N_PAGES
    # Written from the pool's regions (writev), stored as SGLang's flat page: the copying path reads it.
    flat = r.get(keys[2], dst.get_dummy_flat_data_page())
    assert flat.view(torch.uint8).numpy().tobytes() == page_bytes(src, idx, N_PAGES)[2]


def test_batch_exists_is_the_longest_stored_prefix(target: dict[str, Any]) -> None:
    pool = host_pool()
    idx = fill(pool, N_PAGES, seed=2)
    keys = page_keys(2)
    b = backend(target, pool)
    # Store pages 0, 1, 2 and 4: page 3 is a hole.
    stored = [0, 1, 2, 4]
    sel = torch.cat([idx[p * PAGE : (p + 1) * PAGE] for p in stored])
    assert b.batch_set_v1([keys[p] for p in stored], sel) == [True] * 4
    fresh = backend(target, host_pool())  # nothing remembered: every answer comes from the store
    assert fresh.batch_exists(keys) == 3
    assert fresh.batch_exists(keys[:3]) == 3
    assert fresh.batch_exists(keys[4:5] + keys[:2]) == 3
    assert fresh.batch_exists(keys[3:]) == 0
    assert fresh.exists(keys[4]) and not fresh.exists(keys[3])
    # A read past the hole loads the prefix and misses the rest.
    dst = host_pool()
    idx2 = dst.alloc(N_PAGES * PAGE)
    assert fresh.batch_get_v1(keys, idx2) == [True, True, True, False, True, False]


def test_survives_a_restart_on_the_same_store(target: dict[str, Any]) -> None:
    src = host_pool()
    idx = fill(src, N_PAGES, seed=3)
    keys = page_keys(3)
    first = backend(target, src)
    assert all(first.batch_set_v1(keys, idx))
    first.close()
    del first
    dst = host_pool()
    idx2 = dst.alloc(N_PAGES * PAGE)
    again = backend(target, dst)
    assert again.batch_exists(keys) == N_PAGES
    assert all(again.batch_get_v1(keys, idx2))
    assert page_bytes(dst, idx2, N_PAGES) == page_bytes(src, idx, N_PAGES)


def test_salts_are_isolated(target: dict[str, Any]) -> None:
    pool = host_pool()
    idx = fill(pool, N_PAGES, seed=4)
    keys = page_keys(4)
    a = backend(target, pool, salt="tenant-a")
    assert all(a.batch_set_v1(keys, idx))
    assert backend(target, host_pool(), salt="tenant-a").batch_exists(keys) == N_PAGES
    assert backend(target, host_pool(), salt="tenant-b").batch_exists(keys) == 0
    assert backend(target, host_pool()).batch_exists(keys) == 0
    # SGLang's per-request cache_salt seeds its page hashes: another salt, other keys, no hit.
    salted = page_keys(4, salt="request-salt")
    assert set(salted).isdisjoint(keys)
    assert backend(target, host_pool(), salt="tenant-a").batch_exists(salted) == 0
    # The salt itself never appears in the store's names.
    names = [o.name for o in a.store.list(target["prefix"] + "/")]
    assert names and not any("tenant-a" in n for n in names)


def test_tp_ranks_are_isolated_and_mla_shares_one_writer(target: dict[str, Any]) -> None:
    pool = host_pool()
    idx = fill(pool, N_PAGES, seed=5)
    keys = page_keys(5)
    tp0 = backend(target, pool, tp_rank=0, tp_size=2)
    assert all(tp0.batch_set_v1(keys, idx))
    assert backend(target, host_pool(), tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert backend(target, host_pool(), tp_rank=0, tp_size=4).batch_exists(keys) == 0
    assert backend(target, host_pool(), tp_rank=0, tp_size=2).batch_exists(keys) == N_PAGES
    # MLA: KV is the same on every TP rank; SGLang's writer (rank 0) writes, every rank reads.
    mla_keys = page_keys(6)
    dst = host_pool()
    reader = backend(target, dst, tp_rank=1, tp_size=2, mla=True)
    assert not reader.storage_config.is_storage_writer
    assert reader.batch_set_v1(mla_keys, idx) == [False] * N_PAGES  # nothing written, nothing claimed
    assert reader.batch_exists(mla_keys) == 0
    writer = backend(target, pool, tp_rank=0, tp_size=2, mla=True)
    assert all(writer.batch_set_v1(mla_keys, idx))
    # A fresh reader: the Hub store caches lookups (metadata_cache_ttl_secs, 30 s by default),
    # so the reader that just missed may keep missing that long (a miss, never a wrong page).
    reader = backend(target, dst, tp_rank=1, tp_size=2, mla=True)
    assert reader.batch_exists(mla_keys) == N_PAGES
    idx2 = dst.alloc(N_PAGES * PAGE)
    assert all(reader.batch_get_v1(mla_keys, idx2))
    assert page_bytes(dst, idx2, N_PAGES) == page_bytes(pool, idx, N_PAGES)


def test_layouts_never_mix(target: dict[str, Any]) -> None:
    """layer_first and page_first pages hold the same KV in another byte order: other names."""
    lf = host_pool("layer_first")
    idx = fill(lf, N_PAGES, seed=7)
    keys = page_keys(7)
    assert all(backend(target, lf).batch_set_v1(keys, idx))
    pf = host_pool("page_first")
    b = backend(target, pf)
    assert b.batch_exists(keys) == 0
    idx2 = fill(pf, N_PAGES, seed=7)  # same values, page_first order
    assert all(b.batch_set_v1(keys, idx2))
    dst = host_pool("page_first")
    idx3 = dst.alloc(N_PAGES * PAGE)
    assert all(backend(target, dst).batch_get_v1(keys, idx3))
    assert page_bytes(dst, idx3, N_PAGES) == page_bytes(pf, idx2, N_PAGES)


def test_tensor_interface(target: dict[str, Any]) -> None:
    """SGLang's generic (copying) path: get/set/batch_get/batch_set/exists with flat page tensors."""
    pool = host_pool()
    idx = fill(pool, 3, seed=8)
    keys = page_keys(8, n_pages=3)
    b = backend(target, pool)
    pages = [pool.get_data_page(int(idx[p * PAGE]), flat=True) for p in range(3)]
    assert b.batch_set(keys[:2], pages[:2]) is True
    assert b.set(keys[2], pages[2]) is True
    assert b.exists(keys[2])
    r = backend(target, host_pool())
    got = r.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g.view(torch.uint8), p.view(torch.uint8)) for g, p in zip(got, pages, strict=True))
    one = r.get(keys[1], pool.get_dummy_flat_data_page())
    assert torch.equal(one.view(torch.uint8), pages[1].view(torch.uint8))
    assert r.get(page_keys(9, n_pages=1)[0], pool.get_dummy_flat_data_page()) is None
    assert r.clear() is True
    assert backend(target, host_pool()).batch_exists(keys) == 0


def test_a_damaged_page_is_a_miss(target: dict[str, Any]) -> None:
    """A page whose bytes changed in the store is never loaded (kvbucket's sealed objects)."""
    pool = host_pool()
    idx = fill(pool, 2, seed=10)
    keys = page_keys(10, n_pages=2)
    b = backend(target, pool)
    assert all(b.batch_set_v1(keys, idx))
    name = b._name(keys[1])
    raw = b._raw.get(name)
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    b._raw.put(name, bytes(bad))
    dst = host_pool()
    idx2 = dst.alloc(2 * PAGE)
    r = backend(target, dst)
    # Pages are read in place into the pool and verified there: the damaged one answers False, so
    # SGLang (which loads the pages before the first False and frees the rest) never uses its slot.
    assert r.batch_get_v1(keys, idx2) == [True, False]
    assert page_bytes(dst, idx2, 2)[0] == page_bytes(pool, idx, 2)[0]
    assert r._raw.head(name) is None  # removed from the store: the next backup rewrites it
    assert r.batch_exists(keys) == 1  # and this worker no longer counts it as stored


def test_a_page_this_worker_cannot_open_is_left_for_its_writer(target: dict[str, Any], tmp_path: Any) -> None:
    """A worker without the writer's keyring misses, and removes nothing (docs/integrity.md,
    "What a reader may delete"): the writer still loads every page."""
    import base64

    keyring = tmp_path / "keys.json"
    keyring.write_text(json.dumps({"tenants": {"*": {"1": base64.b64encode(os.urandom(32)).decode()}}}))
    enc = {"keyring_file": str(keyring)}
    pool = host_pool()
    idx = fill(pool, 2, seed=12)
    keys = page_keys(12, n_pages=2)
    assert all(backend(target, pool, encryption=enc).batch_set_v1(keys, idx))
    dst = host_pool()
    idx2 = dst.alloc(2 * PAGE)
    assert backend(target, dst).batch_get_v1(keys, idx2) == [False, False]  # no keyring: misses
    dst = host_pool()
    idx3 = dst.alloc(2 * PAGE)
    assert backend(target, dst, encryption=enc).batch_get_v1(keys, idx3) == [True, True]
    assert page_bytes(dst, idx3, 2) == page_bytes(pool, idx, 2)


def test_fleet_refuses_over_capacity_and_evicts_what_was_not_read(target: dict[str, Any]) -> None:
    """The fleet keys through SGLang's factory: a page past the shared capacity is a failed set;
    eviction (down to 60%) takes the pages not read since; the worker forgets what it deleted;
    closing publishes the fleet's journal."""
    sub = fleet_target(target)  # a fleet of its own
    pool = host_pool()
    idx = fill(pool, N_PAGES, seed=11)
    keys = page_keys(11)
    size = len(page_bytes(pool, idx, 1)[0])
    fleet = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 3.0, "grace_secs": 1.0,
             "write_cap": 1.0}  # the cap at the capacity itself: the 5th page is refused
    b = backend(sub, pool, fleet=fleet, max_capacity_gb=4 * size / 1024**3)
    assert b._fleet is not None and b._fleet.fleet.wait_ready(30)
    assert b.batch_set_v1(keys, idx) == [True] * 4 + [False] * 2
    dst = host_pool()
    assert b.batch_get_v1(keys[:2], dst.alloc(2 * PAGE)) == [True, True]  # read: kept
    deadline = time.monotonic() + 30
    while b._fleet.status()["bytes_used"] > 2.4 * size:
        assert time.monotonic() < deadline, b._fleet.status()
        time.sleep(0.05)
    fresh = backend(sub, host_pool())
    assert [fresh.exists(k) for k in keys] == [True, True, False, False, False, False]
    assert [b.exists(k) for k in keys[:4]] == [True, True, False, False]  # forgotten, not "known"
    status = b._fleet.status()
    assert status["refused_chunks"] == 2 and status["evicted_own"] == 2
    b.close()
    assert any(i.name.startswith("_fleet/") for i in fresh._raw.list(""))


def _store_gets(store: str) -> float:
    """Objects the sglang tier's store has been asked to read (kvbucket's store counter, labelled
    with the store's URL as every series of the store is)."""
    from prometheus_client import REGISTRY

    return sum(REGISTRY.get_sample_value("kvbucket_store_objects_total",
                                         {"store": store, "op": "get", "result": r}) or 0.0
               for r in ("hit", "miss", "error"))


def _read_ahead(store: str, outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvbucket_read_ahead_bytes_total",
                                     {"store": store, "outcome": outcome}) or 0.0


def test_batch_exists_reads_ahead_for_batch_get_v1(target: dict[str, Any]) -> None:
    """A batch_exists hit starts the pages' load; SGLang's batch_get_v1 then takes them without
    asking the store again (read-ahead; docs/read-ahead.md). Off: batch_exists reads nothing."""
    src = host_pool()
    idx = fill(src, N_PAGES, seed=11)
    keys = page_keys(11)
    assert all(backend(target, src).batch_set_v1(keys, idx))
    dst = host_pool()
    idx2 = dst.alloc(N_PAGES * PAGE)
    r = backend(target, dst)
    url = r._raw.url
    used = _read_ahead(url, "used")
    assert r.batch_exists(keys) == N_PAGES
    assert r.store.settle()
    gets = _store_gets(url)
    assert r.batch_get_v1(keys, idx2) == [True] * N_PAGES
    assert _store_gets(url) == gets  # every page came from the read-ahead: no request
    assert page_bytes(dst, idx2, N_PAGES) == page_bytes(src, idx, N_PAGES)
    assert _read_ahead(url, "used") - used == N_PAGES * len(page_bytes(src, idx, 1)[0])
    off = backend(target, host_pool(), read_ahead=False)
    gets = _store_gets(url)
    assert off.batch_exists(keys) == N_PAGES
    assert _store_gets(url) == gets  # off: a lookup reads nothing


def test_one_layer_changed_in_place_misses_then_its_bytes_back_hit(tmp_path: Any) -> None:
    """Issue 38 through SGLang's own classes, each step in a fresh process: the backend's identity
    comes from the model path SGLang names (HiCacheStorageConfig.model_name); after one layer's
    bytes change in place every page misses and nothing is deleted; the original bytes back,
    every page hits, byte-identical (kvbucket.testing.redeploy).
    Every store at once: each step is one fresh process over the three stores (three processes,
    not nine: each costs seconds of SGLang imports); each store keeps its own prefix, and every
    assertion names the store that failed. Not parametrized: tests/engines/test_sglang.py counts it once."""
    from pathlib import Path

    from kvbucket.testing.redeploy import check_targets, make_model

    check_targets("sglang", make_model(Path(tmp_path) / "model"), TARGETS)


def test_model_identity_other_weights_revision_or_rope_miss_and_delete_nothing(
        target: dict[str, Any], tmp_path: Any) -> None:
    """SGLang's model path redeployed with other weights or another rope_scaling, and a Hub repo id
    at another revision (the local Hub cache's refs/main moved): every lookup and read misses,
    nothing is deleted; the first model's files again (copied anew) hit every page, byte-identical."""
    import shutil
    from pathlib import Path

    from huggingface_hub import constants

    from kvbucket.testing.identity_models import COMMITS, hub_snapshot, make_model_dirs

    dirs = make_model_dirs(Path(tmp_path) / "models")
    live = Path(tmp_path) / "serve" / "llama"

    def deploy(variant: str) -> None:
        shutil.rmtree(live, ignore_errors=True)
        shutil.copytree(dirs[variant], live)
        now = time.time_ns()
        os.utime(live / "model.safetensors", ns=(now, now))

    def read_all(b: KVBucketHiCacheStorage, keys: list[str]) -> tuple[int, list[bool], list[bytes]]:
        dst = b.mem_pool_host
        idx2 = dst.alloc(N_PAGES * PAGE)
        got = b.batch_get_v1(keys, idx2)
        return b.batch_exists(keys), got, page_bytes(dst, idx2, N_PAGES)

    src = host_pool()
    idx = fill(src, N_PAGES, seed=41)
    keys = page_keys(41)
    deploy("base")
    a = backend(target, src, model=str(live))
    assert a.identity is not None and a.identity.weights.startswith("files:")
    assert a.batch_set_v1(keys, idx) == [True] * N_PAGES
    want = page_bytes(src, idx, N_PAGES)
    before = target_listing(target)
    assert any(f"~{a.identity.token}/" in k for k in before)
    assert any("/_identity/" in k for k in before), "the first writer records its identity"
    for variant in ("weights", "rope"):
        deploy(variant)
        b = backend(target, host_pool(), model=str(live))
        assert b.identity is not None and b.identity.token != a.identity.token, variant
        hits, got, _ = read_all(b, keys)
        assert hits == 0 and got == [False] * N_PAGES, variant
        assert target_listing(target) == before, f"{variant}: nothing deleted"
    deploy("base")
    c = backend(target, host_pool(), model=str(live))
    hits, got, data = read_all(c, keys)
    assert hits == N_PAGES and got == [True] * N_PAGES and data == want
    # a Hub repo id: the weights are the local Hub cache's refs/main commit (no request)
    repo = Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE) / "models--org--llama"
    for commit in COMMITS:
        hub_snapshot(repo, commit, dirs["base"])
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMITS[0])
    d = backend(target, src, model="org/llama")
    assert d.identity is not None and d.identity.weights == f"hub:{COMMITS[0]}"
    assert d.batch_set_v1(keys, idx) == [True] * N_PAGES
    before = target_listing(target)
    (repo / "refs" / "main").write_text(COMMITS[1])  # a new revision was pulled
    e = backend(target, host_pool(), model="org/llama")
    assert read_all(e, keys)[:2] == (0, [False] * N_PAGES)
    assert target_listing(target) == before
    f = backend(target, host_pool(), model="org/llama", revision=COMMITS[0])
    hits, got, data = read_all(f, keys)
    assert hits == N_PAGES and got == [True] * N_PAGES and data == want
