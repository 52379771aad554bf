"""kvbucket's metrics for LMCache users: the L2 adapter and the non-MP connector, each loaded by
the real lmcache package, count their store's requests (``InstrumentedStore`` under the sealing
layer: sizes are what went over the wire, envelope included) and serve them on ``metrics_port``.

``metrics_port`` is a metrics-only endpoint: the connector's GPU worker processes have no other
(vLLM's ``/metrics`` is served by its API server process), and ``lmcache server`` serves the
registry on its HTTP API (``--http-port``), next to admin routes such as ``/cache/clear``. The
endpoint is started once per process and port and lives as long as the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvbucket.envelope import HEADER_SIZE
from kvbucket.errors import ConfigError
from kvbucket.integrations.lmcache import KVBucketL2Adapter, connector_config_from_extra
from kvbucket.l2 import parse_l2_config
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.l2 import lmcache_memory_obj, wait_fd
from kvbucket.testing.s3_server import free_port

pytestmark = pytest.mark.lmcache

CHUNK = 64 * 1024


def create_plugin(params: dict[str, Any]) -> Any:
    """The adapter as ``lmcache server --l2-adapter '<spec>'`` builds it (LMCache's own factory)."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter", "adapter_params": params})  # fmt: skip
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return create_l2_adapter(cfg.adapters[0])


def lmkey(i: int) -> Any:
    from lmcache.v1.distributed.api import ObjectKey as LMKey

    return LMKey(chunk_hash=i.to_bytes(16, "big"), model_name="org/llama", kv_rank=0x01000100,
                 object_group_id=0, cache_salt="")  # fmt: skip


def scrape(port: int) -> str:
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def samples(text: str, store: str) -> dict[tuple[str, ...], float]:
    """``(series, op or direction, result)`` -> value for one store label."""
    out: dict[tuple[str, ...], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("store") != store:
                continue
            if s.name == "kvbucket_store_objects_total":
                out[("objects", s.labels["op"], s.labels["result"])] = s.value
            elif s.name == "kvbucket_store_bytes_total":
                out[("bytes", s.labels["direction"])] = s.value
            elif s.name == "kvbucket_store_latency_seconds_count":
                out[("calls", s.labels["op"])] = s.value
            elif s.name == "kvbucket_read_ahead_bytes_total":
                out[("read_ahead", s.labels["outcome"])] = s.value
    return out


def hf_params(b: HubBucket, port: int) -> dict[str, Any]:
    return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint, "metrics_port": port}  # fmt: skip


def test_plugin_adapter_serves_its_store_requests_on_metrics_port(hub_bucket: HubBucket) -> None:
    port = free_port()
    adapter = create_plugin(hf_params(hub_bucket, port))
    url = f"hf://buckets/{hub_bucket.bucket_id}/kv"
    try:
        assert isinstance(adapter, KVBucketL2Adapter) and adapter.metrics.port == port
        assert adapter.impl.wait_until_rebuilt(30)
        before = samples(scrape(port), url)
        keys = [lmkey(1), lmkey(2)]
        tid = adapter.submit_store_task(keys, [lmcache_memory_obj(bytes([i]) * CHUNK) for i in (1, 2)])
        assert wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[tid].is_successful()
        tid = adapter.submit_lookup_and_lock_task(keys, {})  # a hit starts its read-ahead
        assert wait_fd(adapter.get_lookup_and_lock_event_fd())
        assert adapter.query_lookup_and_lock_result(tid).get_indices_list() == [0, 1]
        outs = [lmcache_memory_obj(bytes(CHUNK)) for _ in keys]
        tid = adapter.submit_load_task(keys, outs)
        assert wait_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(tid).popcount() == 2
        assert [bytes(o.byte_array) for o in outs] == [bytes([i]) * CHUNK for i in (1, 2)]
        adapter.submit_unlock(keys)
        text = scrape(port)
    finally:
        adapter.close()
    got = samples(text, url)
    delta = {k: v - before.get(k, 0.0) for k, v in got.items()}
    sealed = CHUNK + HEADER_SIZE  # the envelope is part of every request's body
    # each object written once and read once (the load took what the lookup's read-ahead fetched)
    assert delta[("objects", "put", "ok")] == 2 and delta[("bytes", "write")] == 2 * sealed
    assert delta[("objects", "get", "hit")] == 2 and delta[("bytes", "read")] == 2 * sealed
    assert delta[("calls", "put")] >= 1 and delta[("calls", "get")] >= 1
    assert delta[("read_ahead", "used")] == 2 * CHUNK  # the read-ahead's series, under the same URL
    assert f'store="{url}"' in text
    assert hub_bucket.hub.write_token not in text  # the adapter's token never reaches the metrics


def test_two_adapters_of_one_process_share_the_endpoint(tmp_path: Path) -> None:
    port = free_port()
    adapters = [create_plugin({"type": "fs", "base_path": str(tmp_path / d), "metrics_port": port})
                for d in "ab"]
    try:
        assert adapters[1].metrics is adapters[0].metrics  # started once: the second did not fail
        for a in adapters:
            tid = a.submit_store_task([lmkey(1)], [lmcache_memory_obj(b"x" * 4096)])
            assert wait_fd(a.get_store_event_fd())
            assert a.pop_completed_store_tasks()[tid].is_successful()
        text = scrape(port)
        for d in "ab":  # each store under its own URL
            assert samples(text, f"file://{tmp_path / d}")[("objects", "put", "ok")] == 1
    finally:
        for a in adapters:
            a.close()
    with pytest.raises(ConfigError, match=r"already serves kvbucket's metrics on 127\.0\.0\.1"):
        create_plugin({"type": "fs", "base_path": str(tmp_path / "c"), "metrics_port": port,
                       "metrics_addr": "0.0.0.0"})  # fmt: skip


def test_a_taken_port_is_a_clear_error_before_the_store_opens(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"127\.0\.0\.1:{port} \(metrics_port\): the port is in use by "
                                             r"another process; set metrics_port to a free port"):
            create_plugin({"type": "fs", "base_path": str(tmp_path / "kv"), "metrics_port": port})
    assert not (tmp_path / "kv").exists()  # nothing was opened


def test_open_l2_adapter_serves_metrics_port_as_the_plugin_does(tmp_path: Path) -> None:
    """Issue 31 item 12: metrics_port means the same wherever it is accepted: open_l2_adapter (the
    library's way to an adapter) serves it too, instead of accepting it and serving nothing."""
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import open_l2_adapter

    port = free_port()
    adapter = open_l2_adapter({"type": "fs", "base_path": str(tmp_path / "kv"), "metrics_port": port})
    try:
        key = ObjectKey("m", 0x01000100, (1).to_bytes(8, "big"), "")
        tid = adapter.submit_store_task([key], [b"x" * 4096])
        assert wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[tid].success
        text = scrape(port)
        assert samples(text, f"file://{tmp_path / 'kv'}")[("objects", "put", "ok")] == 1
    finally:
        adapter.close()


def test_start_metrics_server_on_a_taken_port_gives_the_same_line(tmp_path: Path) -> None:
    """Issue 31 item 12: start_metrics_server on a busy port is the ConfigError line metrics_port gives
    (naming its parameter), not a raw OSError."""
    from kvbucket.metrics_server import start_metrics_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port} \(start_metrics_server's port\): the "
                                              r"port is in use by another process"):
            start_metrics_server(port)


def test_metrics_settings_are_validated_with_the_fix_in_the_message(tmp_path: Path) -> None:
    base = {"type": "fs", "base_path": str(tmp_path)}
    for port in (0, 65536, -1):
        with pytest.raises(ConfigError, match=r"field 'metrics_port': must be a TCP port from 1 to 65535"):
            parse_l2_config({**base, "metrics_port": port})
    with pytest.raises(ConfigError, match="'metrics_port': Input should be a valid integer"):
        parse_l2_config({**base, "metrics_port": "9464"})  # strict JSON spec, as every other field
    for addr in ("http://0.0.0.0", "127.0.0.1:9464", ""):
        with pytest.raises(ConfigError, match=r"'metrics_addr': must be an address of this host.*no port"):
            parse_l2_config({**base, "metrics_port": 9464, "metrics_addr": addr})
    with pytest.raises(ConfigError, match="metrics_addr is set but metrics_port is not"):
        parse_l2_config({**base, "metrics_addr": "0.0.0.0"})
    cfg = parse_l2_config({**base, "metrics_port": 9464, "metrics_addr": "::"})
    assert (cfg.metrics_port, cfg.metrics_addr) == (9464, "::")
    assert parse_l2_config(base).metrics_port is None  # off unless asked
    # the connector's keys, read as leniently as LMCache reads plugin options
    pre = "remote_storage_plugin.kv."
    handle = {pre + "bucket_handle": f"file://{tmp_path}"}
    assert connector_config_from_extra({**handle, pre + "metrics_port": "9464"}, "kv").metrics_port == 9464
    with pytest.raises(ConfigError, match=r"plugin\.kv\.\*: field 'metrics_port': must be a TCP port"):
        connector_config_from_extra({**handle, pre + "metrics_port": 70000}, "kv")


# ---- the non-MP connector, loaded by LMCache's remote_storage_plugins --------------------------------
PRE = "remote_storage_plugin.kvbucket."


def engine(options: dict[str, Any], worker: int = 0) -> tuple[Any, Any, Any]:
    """LMCache's engine config, metadata (GPU worker ``worker`` of two) and CPU backend, with
    kvbucket's connector as the remote storage plugin, configured by ``options``."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    extra = {PRE + "module_path": "kvbucket.integrations.lmcache", PRE + "class_name": "KVBucketConnector",
             **{PRE + k: v for k, v in options.items()}}
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=False,
        remote_serde="naive", remote_storage_plugins=["kvbucket"], extra_config=extra,
    )  # fmt: skip
    md = LMCacheMetadata(model_name="org/llama", world_size=2, local_world_size=2, worker_id=worker,
                         local_worker_id=worker, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 8),
                         chunk_size=16)  # fmt: skip
    return cfg, md, LocalCPUBackend(cfg, md, dst_device="cpu")


def test_connector_serves_its_store_requests_on_metrics_port_plus_worker(
    hub_bucket: HubBucket, lm_loop: asyncio.AbstractEventLoop
) -> None:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    port = free_port()
    url = f"hf://buckets/{hub_bucket.bucket_id}/nonmp"
    # the host's second GPU worker: metrics_port + its local worker id (a string, as in LMCache's YAML)
    cfg, md, cpu = engine({"bucket_handle": url, "token": hub_bucket.hub.write_token,
                           "endpoint": hub_bucket.hub.endpoint, "metrics_port": str(port - 1)}, worker=1)
    backend = RemoteBackend(cfg, md, lm_loop, cpu, "cpu", plugin_name="kvbucket")
    try:
        assert "kvbucket_store_objects_total" in scrape(port)  # served on port - 1 + 1
        keys = [CacheEngineKey("org/llama", 2, 1, h, torch.bfloat16) for h in (0x11, 0x22)]
        objs = []
        for i in range(2):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(i + 1)
            objs.append(obj)
        size = objs[0].get_size()
        backend.batched_submit_put_task(keys, objs)
        deadline = time.monotonic() + 30  # LMCache's put is asynchronous, without a handle
        while samples(scrape(port), url).get(("objects", "put", "ok"), 0) < 2:
            assert time.monotonic() < deadline, "the connector's puts never showed up on /metrics"
            time.sleep(0.05)
        got = backend.get_blocking(keys[1])
        assert got is not None and bytes(got.byte_array) == bytes([2]) * size
        got.ref_count_down()
        for obj in objs:
            obj.ref_count_down()
        text = scrape(port)
    finally:
        backend.close()
    s = samples(text, url)
    assert s[("objects", "put", "ok")] == 2 and s[("bytes", "write")] == 2 * (size + HEADER_SIZE)
    assert s[("objects", "get", "hit")] == 1 and s[("bytes", "read")] == size + HEADER_SIZE
    assert hub_bucket.hub.write_token not in text


def test_connector_on_a_taken_port_names_its_key(tmp_path: Path, lm_loop: asyncio.AbstractEventLoop) -> None:
    """LMCache's RemoteBackend logs a connector's failure to start and runs without the remote
    tier (it retries later): the log line says which key to change."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    from kvbucket.integrations.lmcache import KVBucketConnector

    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    lm_log = logging.getLogger("lmcache.v1.storage_backend.remote_backend")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg, md, cpu = engine({"bucket_handle": f"file://{tmp_path}/kv", "metrics_port": port})
        lm_log.addHandler(handler)
        try:
            backend = RemoteBackend(cfg, md, lm_loop, cpu, "cpu", plugin_name="kvbucket")
        finally:
            lm_log.removeHandler(handler)
        assert backend.connection is None
        want = (f"cannot serve kvbucket's metrics on 127.0.0.1:{port} (remote_storage_plugin.kvbucket."
                "metrics_port): the port is in use by another process")
        assert any(want in r.getMessage() for r in logged), [r.getMessage() for r in logged]
        assert not (tmp_path / "kv").exists()  # failed before the store opened
        # a scheduler's connector (lookups only) serves no metrics: the same taken port is no error
        md.role = "scheduler"
        conn = KVBucketConnector(loop=lm_loop, local_cpu_backend=cpu, config=cfg, metadata=md)
        assert conn.metrics is None
        asyncio.run_coroutine_threadsafe(conn.close(), lm_loop).result(10)
