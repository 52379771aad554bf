"""Read-ahead through LMCache 0.5.6's own classes: the MP plugin adapter (``lookup_and_lock`` then
``load``, built by LMCache's ``create_l2_adapter``) and the non-MP connector (``contains`` then
``get_blocking``, through LMCache's ``RemoteBackend``), on the Hub emulator and on SeaweedFS.

A lookup hit starts the load (kvbucket.stores.guard.read_ahead); the load then makes no request once the
read-ahead landed, and none twice while it is on its way. Checked against the emulator's request
counts and the S3 proxy's request log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from kvbucket.integrations.lmcache import KVBucketL2Adapter
from kvbucket.testing.fleet_node import until
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.l2 import lmcache_memory_obj, wait_fd

pytestmark = pytest.mark.lmcache

CHUNK = 64 * 1024


def lmkey(i: int) -> LMKey:
    return LMKey(chunk_hash=i.to_bytes(16, "big"), model_name="org/llama", kv_rank=0x01000100,
                 object_group_id=0, cache_salt="")


def chunks(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes() for _ in range(n)]


def make_adapter(params: dict[str, Any]) -> KVBucketL2Adapter:
    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter", "adapter_params": params})
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    adapter = create_l2_adapter(cfg.adapters[0])
    assert isinstance(adapter, KVBucketL2Adapter)
    return adapter


def store_all(adapter: KVBucketL2Adapter, keys: list[LMKey], data: list[bytes]) -> None:
    tid = adapter.submit_store_task(keys, [lmcache_memory_obj(d) for d in data])
    assert wait_fd(adapter.get_store_event_fd())
    assert adapter.pop_completed_store_tasks()[tid].is_successful()


def write_all(params: dict[str, Any], keys: list[LMKey], data: list[bytes]) -> None:
    """Store ``data`` through an adapter of its own (another process's, in effect), closed after."""
    w = make_adapter(params)
    try:
        store_all(w, keys, data)
    finally:
        w.close()


def lookup(adapter: KVBucketL2Adapter, keys: list[LMKey]) -> list[int]:
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    deadline = time.monotonic() + 30
    while (bm := adapter.query_lookup_and_lock_result(tid)) is None and time.monotonic() < deadline:
        wait_fd(adapter.get_lookup_and_lock_event_fd(), 1)
    assert bm is not None
    return list(bm.get_indices_list())


def load(adapter: KVBucketL2Adapter, keys: list[LMKey]) -> list[bytes]:
    outs = [lmcache_memory_obj(bytes(CHUNK)) for _ in keys]
    tid = adapter.submit_load_task(keys, outs)
    deadline = time.monotonic() + 30
    while (bm := adapter.query_load_result(tid)) is None and time.monotonic() < deadline:
        wait_fd(adapter.get_load_event_fd(), 1)
    assert bm is not None and bm.popcount() == len(keys)
    return [bytes(o.byte_array) for o in outs]


def ready(adapter: KVBucketL2Adapter) -> KVBucketL2Adapter:
    """Once its startup listing is in (lookups then answer from the index, with no request)."""
    assert until(lambda: adapter.impl.report_status()["usage_complete"], 30)
    return adapter


def requests(hub: Any) -> dict[str, int]:
    return {r: s["requests"] for r, s in hub.stats()["routes"].items() if r != "control"}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {r: n - before.get(r, 0) for r, n in after.items() if n - before.get(r, 0)}


def hub_params(b: HubBucket, **extra: Any) -> dict[str, Any]:
    return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint, **extra}  # fmt: skip


def test_mp_load_after_lookup_and_lock_makes_no_request(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    keys, data = [lmkey(i) for i in range(4)], chunks(1, 4)
    write_all(hub_params(hub_bucket), keys, data)
    seen = {}
    for on in (False, True):
        a = ready(make_adapter(hub_params(hub_bucket, read_ahead=on)))
        try:
            s0 = requests(hub)
            assert lookup(a, keys) == [0, 1, 2, 3]
            ahead = a.impl.read_ahead_store
            assert (ahead is not None) == on
            if ahead is not None:
                assert ahead.settle()
            s1 = requests(hub)
            assert load(a, keys) == data
            seen[on] = (delta(s1, s0), delta(requests(hub), s1))
        finally:
            a.close()
    (off_lookup, off_load), (on_lookup, on_load) = seen[False], seen[True]
    assert off_lookup == {}  # answered from the index
    assert on_load == {}  # the load found every byte read ahead
    assert on_lookup == off_load  # the same requests, made once, earlier


def test_mp_a_load_during_the_read_ahead_fetches_nothing_twice(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    keys, data = [lmkey(10 + i) for i in range(4)], chunks(2, 4)
    write_all(hub_params(hub_bucket), keys, data)
    totals = {}
    for on in (False, True):
        a = ready(make_adapter(hub_params(hub_bucket, read_ahead=on)))
        hub.faults.add("fetch", latency_s=0.3)  # the read-ahead is still on its way at the load
        try:
            s0 = requests(hub)
            assert lookup(a, keys) == [0, 1, 2, 3]
            assert load(a, keys) == data
            totals[on] = delta(requests(hub), s0)
            ahead = a.impl.read_ahead_store
            if ahead is not None:  # the load took the reads' destinations: nothing to copy after
                assert (ahead.redirected, ahead.redirect_copied) == (4, 0)
        finally:
            hub.faults.reset()
            a.close()
    assert totals[True] == totals[False]


@pytest.fixture
def s3_params(seaweedfs: Any, s3_bucket: str, fault_proxy: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    cfg = seaweedfs.config(s3_bucket, "l2", s3_endpoint_url=fault_proxy.url)
    cfg.pop("s3_num_io_threads")
    cfg["s3_endpoint"] = f"s3://{s3_bucket}/l2"
    yield {"type": "s3", **{k: v.get_secret_value() if hasattr(v, "get_secret_value") else v
                            for k, v in cfg.items()}}, fault_proxy


@pytest.mark.parametrize("settled", [True, False])
def test_mp_on_s3_lookup_then_load_is_one_round_trip(s3_params: Any, settled: bool) -> None:
    params, proxy = s3_params
    keys, data = [lmkey(20 + i) for i in range(16)], chunks(3, 16)
    write_all(params, keys, data)
    a = ready(make_adapter(params))
    try:
        proxy.latency = 0.8  # longer than the spread of a batch's arrivals on a machine busy with other tests
        start = len(proxy.log)
        assert lookup(a, keys) == list(range(16))  # from the startup listing's index: no request
        ahead = a.impl.read_ahead_store
        assert ahead is not None
        if settled:
            assert ahead.settle()
        mark = len(proxy.log)
        assert load(a, keys) == data
        gets = [t for m, t, _, _ in proxy.log[start:] if m == "GET" and "list-type" not in t]
        assert len(gets) == 16  # each chunk fetched once, by the read-ahead
        if settled:
            assert len(proxy.log) == mark  # the load sent nothing
        assert proxy.round_trips(start) == 1
    finally:
        proxy.latency = 0.0
        a.close()


def test_connector_contains_then_get_blocking_makes_no_request(hub_bucket: HubBucket) -> None:
    """The non-MP connector inside LMCache's RemoteBackend: a contains hit reads ahead."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    hub = hub_bucket.hub
    pre = "remote_storage_plugin.kvb."
    extra = {pre + "module_path": "kvbucket.integrations.lmcache", pre + "class_name": "KVBucketConnector",
             pre + "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/conn",
             pre + "token": hub.write_token, pre + "endpoint": hub.endpoint}  # fmt: skip
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["kvb"], extra_config=extra)  # fmt: skip
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8),
                         chunk_size=16)  # fmt: skip
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in (0x61, 0x62, 0x63)]
    try:
        writer = RemoteBackend(cfg, md, loop, cpu, "cpu", plugin_name="kvb")
        objs = []
        for i, _ in enumerate(keys):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(0x30 + i)
            objs.append(obj)
        writer.batched_submit_put_task(keys, objs)
        assert until(lambda: writer.batched_contains(keys) == 3, 30)
        for obj in objs:
            obj.ref_count_down()
        writer.close()
        backend = RemoteBackend(cfg, md, loop, cpu, "cpu", plugin_name="kvb")  # a fresh process's view
        try:
            assert backend.batched_contains(keys) == 3
            ahead = backend.connection._connector.store  # LMCache wraps the connector (instrumented)
            assert ahead.settle()
            s0 = requests(hub)
            for i, key in enumerate(keys):
                got = backend.get_blocking(key)
                assert got is not None and bytes(got.byte_array) == bytes([0x30 + i]) * got.get_size()
                got.ref_count_down()
            assert delta(requests(hub), s0) == {}  # every chunk came from the read-ahead
        finally:
            backend.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
        loop.close()


@pytest.mark.parametrize("read_ahead", [False, True])
def test_mp_a_64_chunk_load_on_a_fresh_adapter_lands(hub_bucket: HubBucket, read_ahead: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup answered from the index sends nothing, so the load's 64 reconstruction queries
    (on the client's 64 request threads) each need the read token first. Its fetch was queued on
    those same threads and never started: every load passed load_timeout_secs (bench_l2 at
    64 x 2 MiB, read-ahead and prefetch_reconstructions off)."""
    monkeypatch.setattr(sys.modules[__name__], "CHUNK", 4096)
    keys, data = [lmkey(500 + 100 * read_ahead + i) for i in range(64)], chunks(5, 64)
    params = hub_params(hub_bucket, read_ahead=read_ahead, prefetch_reconstructions=False)
    write_all(params, keys, data)
    a = ready(make_adapter(params))
    try:
        assert lookup(a, keys) == list(range(64))
        assert load(a, keys) == data
    finally:
        a.close()



def _gets(url: str) -> float:
    """Objects the adapter on ``url`` read from its store (kvbucket_store_objects_total)."""
    from prometheus_client import REGISTRY

    return sum(REGISTRY.get_sample_value("kvbucket_store_objects_total",
                                         {"store": url, "op": "get", "result": r}) or 0.0
               for r in ("hit", "miss", "error"))


def _lookup_bitmap(adapter: KVBucketL2Adapter, keys: list[LMKey]) -> Any:
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    deadline = time.monotonic() + 30
    while (bm := adapter.query_lookup_and_lock_result(tid)) is None and time.monotonic() < deadline:
        wait_fd(adapter.get_lookup_and_lock_event_fd(), 1)
    assert bm is not None
    return bm


@pytest.mark.parametrize("held_in_l1", [False, True])
def test_mp_keys_lmcache_loads_elsewhere_are_not_read_ahead_again(hub_bucket: HubBucket,
                                                                  held_in_l1: bool) -> None:
    """LMCache 0.5.6's MP prefetch controller looks every key up in every L2 adapter, L1 hits
    included (``_start_lookup_phase``), lets ``DefaultPrefetchPolicy`` pick one tier per key (L1
    first, then the lowest adapter index) and unlocks the rest (``_plan_load``); a loaded key is
    unlocked after its load (``_poll_load_results``). Driven here step by step with LMCache's own
    policy and bitmap helpers, on two kvbucket adapters that both hold the keys: the second
    adapter's read-ahead (both, when L1 holds the keys) is freed at the unlock, and the next
    request's lookup reads nothing ahead there; once LMCache loads from it, read-ahead resumes."""
    import torch
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc
    from lmcache.v1.distributed.storage_controllers.prefetch_controller import (
        _gather_keys,
        _scatter_bitmaps_full_global,
    )
    from lmcache.v1.distributed.storage_controllers.prefetch_policy import DefaultPrefetchPolicy
    from lmcache.v1.distributed.storage_controllers.utils import (
        Bitmap2D,
        L1ManagerDescriptor,
        L2AdapterDescriptor,
        MapState,
    )

    keys, data = [lmkey(900 + 10 * held_in_l1 + i) for i in range(4)], chunks(9, 4)
    params = [hub_params(hub_bucket, read_ahead_ttl_secs=300.0)
              | {"bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/kv{i}"} for i in range(2)]
    for p in params:
        write_all(p, keys, data)
    adapters = [ready(make_adapter(p)) for p in params]
    ahead = [a.impl.read_ahead_store for a in adapters]
    urls = [r.url for r in ahead]
    group = [GroupedObjectKeys(keys=keys, object_group_id=0,
                               layout_desc=MemoryLayoutDesc([torch.Size([CHUNK])], [torch.uint8]))]
    policy = DefaultPrefetchPolicy()

    def request(l2_holds: list[int], in_l1: bool) -> dict[int, list[LMKey]]:
        """One prefetch request as the controller runs it; returns the keys loaded per adapter."""
        l1, l1_descs = MapState(), {}
        if in_l1:
            l1[0] = Bitmap2D.zeros(1, len(keys)).ones_like()
            l1_descs = {0: L1ManagerDescriptor(index=0, config=None)}  # type: ignore[arg-type]
        l2 = MapState()
        for i in l2_holds:  # every adapter, every key
            bm = _lookup_bitmap(adapters[i], keys)
            assert bm.popcount() == len(keys)
            l2[i] = _scatter_bitmaps_full_global(bm, 1, len(keys))
        l2_descs = {i: L2AdapterDescriptor(index=i, config=None) for i in l2_holds}  # type: ignore[arg-type]
        plan = policy.plan_load(group, l1, l2, l1_descs, l2_descs, "prefix")
        for i, cells in (l2 - plan.l2_planned_keys).items():  # dropped by the plan: unlocked
            if dropped := _gather_keys(group, cells):
                adapters[i].submit_unlock(dropped)
        loaded = {}
        for i, cells in plan.l2_planned_keys.items():  # loaded, then unlocked
            loaded[i] = _gather_keys(group, cells)
            assert load(adapters[i], loaded[i]) == [data[keys.index(k)] for k in loaded[i]]
            adapters[i].submit_unlock(loaded[i])
        return loaded

    try:
        assert request([0, 1], held_in_l1) == ({} if held_in_l1 else {0: keys})
        unloaded = [0, 1] if held_in_l1 else [1]
        for i in unloaded:  # dropped at the unlock (freed once landed), not after read_ahead_ttl_secs
            assert until(lambda i=i: ahead[i].held_bytes == 0, 20)
        gets = [_gets(u) for u in urls]
        assert request([0, 1], held_in_l1) == ({} if held_in_l1 else {0: keys})
        for i in unloaded:  # the second request read nothing ahead where LMCache did not load
            assert ahead[i].settle()
            assert _gets(urls[i]) == gets[i]
            assert adapters[i].impl.report_status()["read_ahead_skipped"] == len(keys)
        if not held_in_l1:  # the first adapter, loaded from, read ahead and loaded once each key
            assert _gets(urls[0]) == gets[0] + len(keys)
        # The keys leave L1 and the first adapter: LMCache loads them from the second, which
        # fetches them with the load, then reads them ahead again on the next lookup.
        adapters[0].delete(keys)
        gets = [_gets(u) for u in urls]
        assert request([1], False) == {1: keys}
        assert _gets(urls[1]) == gets[1] + len(keys)  # fetched by the load, nothing read ahead
        assert _lookup_bitmap(adapters[1], keys).popcount() == len(keys)
        assert ahead[1].settle() and ahead[1].held_bytes > 0  # read ahead again
        adapters[1].submit_unlock(keys)
    finally:
        for a in adapters:
            a.close()
