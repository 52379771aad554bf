"""Benchmark helper: LMCache 0.5.6's own L2 adapters (``hfbucket``, ``s3``), driven as ``lmcache bench l2``
drives them, for the benchmarks that put them next to kvbucket (bench_hfbucket, bench_latency,
bench_ceiling, bench_l2's servers).

A task is submitted, the adapter's eventfd is waited on (``wait_eventfd`` of LMCache's bench), and the
task's bitmap is read; memory objects are ``TensorMemoryObj`` views of the caller's tensors, as
LMCache's ``make_memory_objects`` builds them. LMCache's ``s3`` adapter speaks virtual-hosted style
only: :func:`lmcache_seaweedfs` serves Host ``127.0.0.1:<port>`` as bucket ``127`` (domain ``0.0.1``),
and path-style clients of the same server go to ``localhost``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

#: The bucket LMCache's ``s3`` adapter reaches at ``127.0.0.1:<port>`` (see the module docstring).
LMCACHE_S3_BUCKET = "127"


def memory_obj(tensor: Any) -> Any:
    """A ``TensorMemoryObj`` over ``tensor`` (uint8, one dimension), as LMCache's bench builds them."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    meta = MemoryObjMetadata(shape=torch.Size([tensor.numel()]), dtype=torch.uint8, address=0,
                             phy_size=tensor.numel(), fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=tensor, metadata=meta, parent_allocator=None)


def open_adapter(spec: dict[str, Any], endpoint: str | None = None) -> Any:
    """LMCache's adapter for an ``--l2-adapter`` JSON ``spec``, made by its own factory.

    ``endpoint``: the Hub for the ``hfbucket`` adapter, whose ``HfApi(token=...)`` takes it from
    ``huggingface_hub.constants.ENDPOINT``.
    """
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    if endpoint is not None:
        import huggingface_hub.constants as hc

        hc.ENDPOINT = endpoint
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    return create_l2_adapter(cfg.adapters[0])


def _wait(fd: int, timeout: float) -> None:
    from lmcache.cli.commands.bench.l2_adapter_bench.data import wait_eventfd

    assert wait_eventfd(fd, timeout), f"LMCache's adapter did not answer in {timeout:.0f} s"


def store(adapter: Any, keys: Sequence[Any], objs: Sequence[Any], timeout: float = 600.0) -> int:
    """One store task of every key; asserts every object landed."""
    adapter.submit_store_task(list(keys), list(objs))
    _wait(adapter.get_store_event_fd(), timeout)
    res = adapter.pop_completed_store_tasks()
    assert res and all(int(r) >= 0 for r in res.values()), f"LMCache store failed: {res}"
    return len(keys)


def lookup_and_lock(adapter: Any, keys: Sequence[Any], timeout: float = 600.0) -> int:
    """Hits of one lookup-and-lock task (the keys stay locked: :func:`unlock` them)."""
    tid = adapter.submit_lookup_and_lock_task(list(keys), {})
    while True:
        _wait(adapter.get_lookup_and_lock_event_fd(), timeout)
        bm = adapter.query_lookup_and_lock_result(tid)
        if bm is not None:
            return int(bm.popcount())


def unlock(adapter: Any, keys: Sequence[Any]) -> None:
    adapter.submit_unlock(list(keys))


def load(adapter: Any, keys: Sequence[Any], objs: Sequence[Any], timeout: float = 600.0) -> int:
    """Objects one load task of ``keys`` into ``objs`` found and loaded."""
    tid = adapter.submit_load_task(list(keys), list(objs))
    while True:
        _wait(adapter.get_load_event_fd(), timeout)
        bm = adapter.query_load_result(tid)
        if bm is not None:
            return int(bm.popcount())


def lookup_load(adapter: Any, keys: Sequence[Any], objs: Sequence[Any]) -> int:
    """An engine's hit: lookup-and-lock ``keys``, load them if all hit, unlock."""
    try:
        hits = lookup_and_lock(adapter, keys)
        return load(adapter, keys, objs) if hits == len(keys) else 0
    finally:
        unlock(adapter, keys)


def lmcache_seaweedfs(**kwargs: Any) -> Any:
    """A SeaweedFS (not started) that LMCache's virtual-hosted ``s3`` adapter and path-style clients
    both reach: Host ``127.0.0.1`` is bucket ``127`` (create it), the server's ``endpoint_url`` is
    ``localhost`` for the others."""
    from kvbucket.testing.s3_server import DOMAIN, SeaweedFS

    return SeaweedFS(domain_name=f"{DOMAIN},0.0.1", client_host="localhost", **kwargs)


def s3_adapter_spec(server: Any, port: int | None = None) -> dict[str, Any]:
    """LMCache's ``s3`` adapter on bucket ``127`` of ``server`` (or a proxy of it on ``port``)."""
    return {"type": "s3", "s3_endpoint": f"127.0.0.1:{port or server.port}", "s3_region": server.region,
            "disable_tls": True, "s3_prefer_http2": False, "aws_access_key_id": server.access_key,
            "aws_secret_access_key": server.secret_key}
