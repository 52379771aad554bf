"""A redeploy in place, through each engine path, each step in a fresh process.

One model directory (a tiny Llama written by transformers' ``save_pretrained``: ``config.json``
and ``model.safetensors``); a path stores chunks with it; then one layer's bytes change in place
(:func:`change_one_layer`: inside the file's first MiB, so today's sampled fingerprint sees it as
well as a digest of the whole content); a fresh process of the same path must miss every chunk and
delete nothing; the original bytes back (:func:`restore`), a fresh process hits every chunk with
the stored bytes. Used by tests/test_redeploy_paths.py (library tiers, LMCache's L2 adapter and
connector, transformers) and by the engine checks in the vLLM and SGLang venvs.

``python -m kvbucket.testing.redeploy store|read MODEL_DIR JOBS`` runs one step of each job
(JOBS: JSON ``{name: [path, store]}``) and prints one JSON line ``{name: {"token", "hits",
"digests"}}``: the identity token, the chunks a lookup found (read steps) and the SHA-256 of each
chunk's bytes as stored, or as loaded (None: a miss). Several jobs share the step's one process.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbucket.testing.redeploy_engines import N, digest, sglang_step, vllm_step

LAYER = "model.layers.0.self_attn.k_proj.weight"  # the tensor a "fine-tune" changes
HEAD_LIMIT = 1 << 20  # the change stays inside the file's first MiB


def make_model(root: Path) -> Path:
    """The tiny Llama of kvbucket's demo (seeded weights), saved as a Hugging Face model directory."""
    from kvbucket.demo.model import TINY, build_model

    root.mkdir(parents=True, exist_ok=True)
    build_model(TINY, seed=3, name="org/tiny").save_pretrained(root, safe_serialization=True)
    assert (root / "model.safetensors").is_file(), sorted(p.name for p in root.iterdir())
    return root


def _tensor_span(weights: Path, name: str) -> tuple[int, int]:
    """(offset, length) of a tensor's bytes in a safetensors file, from its header."""
    with open(weights, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start, end = header[name]["data_offsets"]
    return 8 + n + start, end - start


def change_one_layer(root: Path) -> bytes:
    """Flip the low bit of every other byte of one layer's tensor, in place (same size, same
    names: a small fine-tune of one layer); returns the original bytes for :func:`restore`."""
    weights = root / "model.safetensors"
    off, length = _tensor_span(weights, LAYER)
    assert off + length <= HEAD_LIMIT, "the changed layer must lie in the first MiB"
    with open(weights, "r+b") as f:
        f.seek(off)
        original = f.read(length)
        changed = bytearray(original)
        for i in range(0, length, 2):
            changed[i] ^= 0x01
        f.seek(off)
        f.write(changed)
    return original


def restore(root: Path, original: bytes) -> None:
    """Write the layer's original bytes back in place (the file gets a new mtime, not new content)."""
    weights = root / "model.safetensors"
    off, length = _tensor_span(weights, LAYER)
    assert len(original) == length
    with open(weights, "r+b") as f:
        f.seek(off)
        f.write(original)


def objects(store_dir: Path) -> dict[str, bytes]:
    """Every object a directory store holds (name -> bytes): what "deletes nothing" compares."""
    files = sorted(p for p in store_dir.rglob("*") if p.is_file())
    return {str(p.relative_to(store_dir)): p.read_bytes() for p in files}


def target_objects(target: dict[str, Any]) -> dict[str, bytes]:
    """Every object under an engine check's ``{"url", "options", "prefix"}`` target, with its bytes."""
    from kvbucket.stores import open_store

    store = open_store(target["url"], **target.get("options", {}))
    try:
        names = sorted(i.name for i in store.list(target["prefix"] + "/"))
        return {r.name: bytes(r.data or b"") for r in store.get_many(names)} if names else {}
    finally:
        store.close()


def payload(i: int, size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8).tobytes()


# ---- the paths (each step runs in its own process) -------------------------------------------
def _remote(mode: str, model: Path, store: Path) -> dict[str, Any]:
    """The library's remote tier as the engine YAML builds it (``extra_config.model_identity``)."""
    from kvbucket.chunks import KVLayout
    from kvbucket.config import EngineConfig, build_backend
    from kvbucket.testing.backend_tests import as_bytes, key

    layout = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)
    cfg = EngineConfig(local_cpu=False, remote_url=str(store), chunk_size=16,
                       extra_config={"model_identity": str(model)})
    keys = [key(i, "org/tiny") for i in range(N)]
    data = [payload(i, layout.full_chunk_bytes) for i in range(N)]
    with build_backend(cfg, layout) as tier:
        assert tier._identity.wait(120), "the model directory's identity was never known"
        token = tier._identity.token("org/tiny")
        if mode == "store":
            assert tier.batched_put(list(zip(keys, data, strict=True))) == N
            return {"token": token, "hits": None, "digests": [digest(d) for d in data]}
        hits = sum(tier.batched_contains(keys))
        got = [None if g is None else as_bytes(g) for g in tier.batched_get(keys)]
        return {"token": token, "hits": hits, "digests": [digest(g) for g in got]}


def _l2(mode: str, model: Path, store: Path) -> dict[str, Any]:
    """LMCache's MP L2 adapter, built by LMCache's own factory (``adapter_params.model_identity``)."""
    import argparse

    from lmcache.v1.distributed.api import ObjectKey as LMKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from kvbucket.testing.l2 import drain_fd, lmcache_memory_obj, wait_fd

    size = 4096
    params = {"type": "fs", "base_path": str(store), "model_identity": str(model)}
    spec = json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                       "class_name": "KVBucketL2Adapter", "adapter_params": params})
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    adapter = create_l2_adapter(config.adapters[0])
    keys = [LMKey(chunk_hash=(i + 1).to_bytes(16, "big"), model_name="org/tiny", kv_rank=0x01000100,
                  object_group_id=0, cache_salt="") for i in range(N)]  # fmt: skip
    try:
        assert adapter.impl.naming.identity.wait(120), "the model directory's identity was never known"
        token = adapter.impl.naming.identity.token("org/tiny")
        if mode == "store":
            tid = adapter.submit_store_task(keys, [lmcache_memory_obj(payload(i, size)) for i in range(N)])
            assert wait_fd(adapter.get_store_event_fd())
            drain_fd(adapter.get_store_event_fd())
            assert adapter.pop_completed_store_tasks()[tid].is_successful()
            return {"token": token, "hits": None, "digests": [digest(payload(i, size)) for i in range(N)]}
        tid = adapter.submit_lookup_and_lock_task(keys, {})
        assert wait_fd(adapter.get_lookup_and_lock_event_fd())
        drain_fd(adapter.get_lookup_and_lock_event_fd())
        hits = len(adapter.query_lookup_and_lock_result(tid).get_indices_list())
        outs = [lmcache_memory_obj(bytes(size)) for _ in keys]
        tid = adapter.submit_load_task(keys, outs)
        assert wait_fd(adapter.get_load_event_fd())
        drain_fd(adapter.get_load_event_fd())
        loaded = set(adapter.query_load_result(tid).get_indices_list())
        adapter.submit_unlock(keys)
        return {"token": token, "hits": hits,
                "digests": [digest(outs[i].byte_array) if i in loaded else None for i in range(N)]}
    finally:
        adapter.close()


def _connector(mode: str, model: Path, store: Path) -> dict[str, Any]:
    """LMCache's non-MP remote connector (``remote_storage_plugin.<name>.model_identity``), with
    LMCache's own engine config, metadata and CPU backend."""
    import asyncio
    import threading

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    from kvbucket.testing.lmcache_engine import connector

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    conn = connector(loop, {"bucket_handle": f"file://{store}", "metadata_cache_ttl_secs": 0,
                            "model_identity": str(model)}, model="org/tiny", head_dim=16)
    cpu = conn.local_cpu_backend
    keys = [CacheEngineKey("org/tiny", 1, 0, h, torch.bfloat16) for h in range(0x100, 0x100 + N)]
    try:
        assert conn.naming.identity.wait(120), "the model directory's identity was never known"
        token = conn.naming.identity.token("org/tiny")
        if mode == "store":
            sent = []
            for i, k in enumerate(keys):
                obj = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, MemoryFormat.KV_2LTD)
                data = payload(i, obj.get_size())
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                obj.raw_data.view(torch.uint8).view(-1).copy_(raw)
                run(conn.put(k, obj))
                sent.append(digest(data))
            return {"token": token, "hits": None, "digests": sent}
        hits = run(conn.batched_async_contains("t", keys))
        got = run(conn.batched_get(keys))
        return {"token": token, "hits": hits,
                "digests": [None if o is None else digest(o.byte_array) for o in got]}
    finally:
        run(conn.close())
        loop.call_soon_threadsafe(loop.stop)


def _transformers(mode: str, model: Path, store: Path) -> dict[str, Any]:
    """The transformers prefix cache over the remote tier, the model loaded from the directory."""
    import torch

    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout
    from kvbucket.stores.local.file import FileStore
    from kvbucket.testing.backend_tests import as_bytes
    from transformers import AutoModelForCausalLM

    t = 16
    m = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    ids = torch.arange(N * t + 3).remainder(m.config.vocab_size).unsqueeze(0)
    layout = probe_kv_layout(m, t).to_kv_layout()
    with KVBucketPrefixCache(m, RemoteBackend(FileStore(store), layout), chunk_tokens=t,
                             model_id="org/tiny") as c:
        token = c.identity.token
        keys = c.chunk_keys(ids)
        if mode == "store":
            c.prefill(ids)
            assert c.flush()
            hits = None  # the stored chunks, as this process reads them back
        else:
            hits = c.lookup(ids) // t
        got = c.backend.batched_get(keys)
        return {"token": token, "hits": hits, "digests": [digest(as_bytes(g)) if g is not None else None
                                                          for g in got]}


PATHS: dict[str, Callable[[str, Path, Any], dict[str, Any]]] = {
    "remote": _remote, "l2": _l2, "connector": _connector, "transformers": _transformers,
    "vllm": vllm_step, "sglang": sglang_step,  # their engine's imports happen in the step
}


def steps(mode: str, model: Path, jobs: dict[str, tuple[str, str | Path]]) -> dict[str, dict[str, Any]]:
    """One step of every job ``{name: (path, store)}``, all in ONE fresh process of this Python (no
    cache of the caller's process is shared; the model does not change during a step, so the jobs
    of one step may share the new process: a process serving one store sees the same files)."""
    import os
    import subprocess

    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    spec = json.dumps({name: [path, str(store)] for name, (path, store) in jobs.items()})
    cmd = [sys.executable, "-m", "kvbucket.testing.redeploy", mode, str(model), spec]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    out: dict[str, dict[str, Any]] = json.loads(p.stdout.strip().splitlines()[-1])
    assert sorted(out) == sorted(jobs), out
    return out


def step(path: str, mode: str, model: Path, store: str | Path) -> dict[str, Any]:
    """One step of one path in a fresh process (see :func:`steps`)."""
    return steps(mode, model, {path: (path, store)})[path]


def check_all(model: Path, jobs: dict[str, tuple[str, str | Path, Callable[[], dict[str, Any]]]]) -> None:
    """The whole redeploy (see the module docstring) of every job ``{name: (path, store,
    snapshot)}`` at once: each of the three steps is one fresh process running every job, so N
    jobs cost three processes, not 3 N. ``snapshot``: the job's store objects (name -> bytes or
    size), compared before and after each read step. Every assertion is per job, named by it."""
    run = {name: (path, store) for name, (path, store, _) in jobs.items()}
    snap = {name: job[2] for name, job in jobs.items()}
    first = steps("store", model, run)
    before: dict[str, dict[str, Any]] = {}
    for name, got in first.items():
        assert got["token"], f"{name}: no identity from the model directory"
        before[name] = snap[name]()
        chunks = [n for n in before[name] if "_identity" not in n]
        assert len(chunks) == N and all(got["token"] in n for n in chunks), (name, sorted(before[name]))
        manifests = [n for n in before[name] if "/_identity/" in f"/{n}"]
        assert len(manifests) == 1 and manifests[0].endswith(got["token"]), \
            f"{name}: the writer records its manifest"

    original = change_one_layer(model)
    changed = steps("read", model, run)
    for name, got in changed.items():
        assert got["token"] != first[name]["token"], f"{name}: one layer's new bytes are another identity"
        assert got["hits"] == 0 and got["digests"] == [None] * N, (name, got)
        assert snap[name]() == before[name], f"{name}: nothing deleted, nothing rewritten"

    restore(model, original)
    back = steps("read", model, run)
    for name, got in back.items():
        assert got["token"] == first[name]["token"], name
        assert got["hits"] == N and got["digests"] == first[name]["digests"], \
            f"{name}: every chunk, byte-identical"
        assert snap[name]() == before[name], name


def check_targets(path: str, model: Path, targets: dict[str, dict[str, Any]]) -> None:
    """:func:`check_all` of an engine path (``vllm``, ``sglang``) over the engine checks' store
    targets ``{name: {"url", "options"}}``, each under a fresh prefix of its own."""
    import uuid

    jobs: dict[str, tuple[str, str | Path, Callable[[], dict[str, Any]]]] = {}
    for name in sorted(targets):
        t = {**targets[name], "prefix": f"{path}-{uuid.uuid4().hex[:12]}"}
        store = json.dumps({"url": t["url"], "options": t.get("options", {}), "prefix": t["prefix"]})
        jobs[name] = (path, store, lambda t=t: target_objects(t))
    assert jobs, f"{path}: no store targets"
    check_all(model, jobs)


def check(path: str, model: Path, store: str | Path, snapshot: Callable[[], dict[str, Any]]) -> None:
    """The whole redeploy of one path (see :func:`check_all`)."""
    check_all(model, {path: (path, store, snapshot)})


def main(argv: list[str]) -> None:
    """``MODE MODEL JOBS``: JOBS is JSON ``{name: [path, store]}``; prints ``{name: result}``."""
    mode, model, spec = argv
    out = {}
    for name, (path, store) in json.loads(spec).items():
        out[name] = PATHS[path](mode, Path(model), store if path in ("vllm", "sglang") else Path(store))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
