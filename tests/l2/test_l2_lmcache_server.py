"""The real ``lmcache server`` (MP mode, CPU, small L1) with kvbucket's plugin on hfbucket and s3.

One server process holds two plugin adapters: ``hfbucket`` on the Hub emulator and ``s3`` on
SeaweedFS, on free ports (``--port`` for requests, ``--http-port`` for the HTTP API, which
otherwise is fixed at 8080). Chunks put in the buckets beforehand are found by the adapters'
startup listings, listed and deleted through LMCache's own HTTP API (which calls the plugin's
``list_l2_keys`` and ``delete``), and found again after the server restarts on the same buckets.

In the same two server runs, LMCache's own MP client (``LMCacheMPWorkerAdapter`` and
``LMCacheMPSchedulerAdapter``, what vLLM's ``LMCacheMPConnector`` runs; see
:mod:`kvbucket.testing.lmcache_mp`) stores chunks from a paged KV cache, LMCache's ``/cache/clear``
drops them from L1, and a lookup (prefetch from L2) and retrieve bring them back, bytes checked:
from ``hfbucket`` first, then, after the restart with those objects removed from the Hub bucket,
from ``s3``. Both adapters set ``metrics_port``: the server process serves kvbucket's metrics
there, each store's requests under its URL, as it does on LMCache's own HTTP API ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import httpx
from lmcache_server import Server
from prometheus_client.parser import text_string_to_metric_families

from kvbucket.keys import ObjectKey
from kvbucket.l2 import open_l2_adapter
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.l2 import store
from kvbucket.testing.lmcache_mp import BLOCK, MPEngine
from kvbucket.testing.s3_server import S3Server, free_port

pytestmark = pytest.mark.lmcache

N = 4
CHUNK = 8192


def hf_params(b: HubBucket) -> dict[str, Any]:
    return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{b.bucket_id}/kv", "token": b.hub.write_token,
            "endpoint": b.hub.endpoint}  # fmt: skip


def here(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` for an adapter this test process opens: without metrics_port, which open_l2_adapter
    serves (for the rest of the process) and the server process must bind."""
    return {k: v for k, v in spec.items() if k != "metrics_port"}


def s3_params(s: S3Server, bucket: str) -> dict[str, Any]:
    return {"type": "s3", **s.config(bucket, "kv")}


def keys(model: str) -> list[ObjectKey]:
    return [ObjectKey(model, 0, i.to_bytes(16, "big")) for i in range(N)]


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


MP_MODEL = "org/mp-model"
MP_TOKENS = list(range(1000, 1000 + 4 * BLOCK))  # 4 chunks
STORED_BLOCKS, LOADED_BLOCKS = [0, 1, 2, 3], [4, 5, 6, 7]


def mp_retrieve(srv: Server, engine: MPEngine, want: dict[str, Any]) -> None:
    """L1 emptied, then a lookup prefetches the 4 chunks from L2 and a retrieve writes them into
    other blocks of the paged cache: the same bytes as stored."""
    r = httpx.post(srv.url + "/cache/clear", json={"tier": "l1"}, timeout=30)
    assert r.status_code == 200, r.text
    assert srv.l1_objects() == 0
    rid, hit = engine.lookup(MP_TOKENS)
    assert hit == len(MP_TOKENS)
    engine.retrieve(rid, MP_TOKENS, LOADED_BLOCKS)
    got = engine.blocks(LOADED_BLOCKS)
    assert all(bool((got[name] == want[name]).all()) for name in want)


def store_objects(text: str, store: str) -> dict[tuple[str, str], float]:
    """(op, result) -> objects, of one store label of a /metrics text."""
    return {(s.labels["op"], s.labels["result"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvbucket_store_objects_total" and s.labels["store"] == store}


def wait_keys(srv: Server, want: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := [a["keys"] for a in srv.adapters()]) != want:
        assert time.monotonic() < deadline, f"L2 keys per adapter {got}, expected {want}"
        time.sleep(0.1)


@pytest.mark.slow(12)
def test_lmcache_server_runs_the_plugin_on_hfbucket_and_s3(
    hub_bucket: HubBucket, seaweedfs: S3Server, s3_bucket: str, tmp_path: Path, servers: list[Server]
) -> None:
    mport = free_port()  # a metrics-only endpoint in the server process
    specs = [{**p, "metrics_port": mport} for p in (hf_params(hub_bucket), s3_params(seaweedfs, s3_bucket))]
    for spec, model in zip(specs, ("org/hf-model", "org/s3-model"), strict=True):
        with open_l2_adapter(here(spec)) as a:
            assert store(a, keys(model), [bytes([i + 1]) * CHUNK for i in range(N)]).success

    srv = Server(specs, tmp_path / "server.log")
    servers.append(srv)
    srv.wait_ready()
    status = srv.adapters()
    assert [a["store"].split(":")[0] for a in status] == ["hf", "s3"]
    assert [(a["keys"], a["bytes_used"], a["is_healthy"]) for a in status] == [(N, N * CHUNK, True)] * 2
    # LMCache's HTTP API lists and deletes through the plugin (the primary adapter: hfbucket)
    listed = httpx.get(srv.url + "/cache/objects", params={"tier": "l2"}, timeout=30).json()
    assert len(listed["entries"]) == N and {e["size_bytes"] for e in listed["entries"]} == {CHUNK}
    victim = listed["entries"][0]["key"]
    r = httpx.request("DELETE", srv.url + "/cache/objects", json={"keys": [victim], "tier": "l2"}, timeout=30)
    assert r.status_code == 200, r.text
    assert srv.adapters()[0]["keys"] == N - 1

    # LMCache's MP client stores 4 chunks (written to both adapters), then gets them back from L2
    engine = MPEngine(f"tcp://127.0.0.1:{srv.port}", MP_MODEL)
    try:
        engine.store(MP_TOKENS, STORED_BLOCKS)
        want = engine.blocks(STORED_BLOCKS)
        wait_keys(srv, [N - 1 + 4, N + 4])
        mp_retrieve(srv, engine, want)
    finally:
        engine.close()
    assert [a["loads"] > 0 for a in srv.adapters()] == [True, False]  # served by hfbucket, the first
    # both adapters count into one endpoint, each store under its URL: the 4 chunks written to
    # both, and read from hfbucket each once (its read-ahead fetched them, the load took them).
    # LMCache looks every key up in every adapter, so s3's lookup hits start read-aheads too,
    # which no load takes (LMCache loads from one adapter): at most 4 reads there.
    text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).text
    hf, s3 = (store_objects(text, a["store"]) for a in status)
    assert (hf.get(("put", "ok")), s3.get(("put", "ok"))) == (4, 4)
    assert hf.get(("get", "hit")) == 4 and s3.get(("get", "hit"), 0) <= 4
    assert hub_bucket.hub.write_token not in text and seaweedfs.secret_key not in text
    # LMCache 0.5.6's HTTP API serves the same default registry on /metrics (its common routes)
    api = httpx.get(srv.url + "/metrics", timeout=10).text
    assert store_objects(api, status[0]["store"]).get(("put", "ok")) == 4

    srv.stop()  # restart on the same buckets: the plugin finds what is there
    with open_l2_adapter(here(specs[0])) as hf:  # without the Hub's copies, retrieves must come from s3
        mp_keys = [k for k, _ in hf.list_keys(MP_MODEL).entries]
        assert len(mp_keys) == 4 and hf.delete(mp_keys) == [True] * 4
    srv = Server(specs, tmp_path / "server2.log")
    servers.append(srv)
    srv.wait_ready()
    assert [a["keys"] for a in srv.adapters()] == [N - 1, N + 4]
    listed = httpx.get(srv.url + "/cache/objects", params={"tier": "l2"}, timeout=30).json()
    assert victim not in [e["key"] for e in listed["entries"]] and len(listed["entries"]) == N - 1
    engine = MPEngine(f"tcp://127.0.0.1:{srv.port}", MP_MODEL, seed=2)  # a new engine, other bytes
    try:
        mp_retrieve(srv, engine, want)
    finally:
        engine.close()
    assert [a["loads"] > 0 for a in srv.adapters()] == [False, True]
