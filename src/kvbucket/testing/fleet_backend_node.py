"""A fleet node built the way an engine builds its storage backends: from an engine YAML.

Run in a spawned process by :func:`kvbucket.testing.fleet_node.run_fleet` (``target=run_backend_node``):
the process loads the YAML with :func:`kvbucket.config.load_engine_config`, builds the stack
with ``build_backend`` (a HybridBackend: local CPU in front of a RemoteBackend in the prefix's
fleet), writes its own chunks, keeps reading a hot set every node shares (from its CPU tier after
the first read, so the remote tier only hears of the reads as access hints), and reports what
it saw. Plans are plain dicts so they pickle.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvbucket.keys import CacheEngineKey

MODEL = "org/fleet-model"
#: 32 tokens x 2 layers x 2 (K, V) x 2 heads x 64 dims x 2 bytes = 32 KiB a chunk.
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16", "chunk_tokens": 32}


def backend_key(i: int, salt: str = "") -> CacheEngineKey:
    """Chunk ``i``'s key; a salt is LMCache's ``lmcache.tag.cache_salt`` request tag."""
    return CacheEngineKey(MODEL, 1, 0, i, "bfloat16", {"cache_salt": salt} if salt else None)


def backend_chunk(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "big") * (size // 8 + 1))[:size]


def remote_tier(backend: Any) -> Any:
    """The stack's remote tier (the last one)."""
    return backend.tiers[-1] if hasattr(backend, "tiers") else backend


def chunk_bytes(remote: Any) -> dict[str, int]:
    """The remote tier's chunks as the fleet counts them (payload sizes, ``_fleet/`` left out)."""
    from kvbucket.fleet.layout import is_fleet_name

    return {i.name: i.size for i in remote.store.list("") if not is_fleet_name(i.name, "")}


def run_backend_node(spec: dict[str, Any], plan: dict[str, Any], out: Any) -> None:
    """``spec``: ``config`` (the engine YAML's path), ``env`` (variables the YAML's ``*_env`` keys
    name, e.g. a token). ``plan``: ``writes`` (``[salt, first, count]``
    runs), ``batch``, ``pause``, ``hot`` (chunk numbers, unsalted, read after every batch),
    ``settle_bytes`` (then linger, reading the hot set, until the remote prefix holds at most this
    many chunk bytes, at most ``linger`` s), ``after`` (s more, hearing the others' last deletes)."""
    from kvbucket.chunks import KVLayout
    from kvbucket.config import build_backend, load_engine_config

    os.environ.update(spec.get("env", {}))
    config = load_engine_config(spec["config"], env={})
    backend = build_backend(config, KVLayout(**LAYOUT))
    remote = remote_tier(backend)
    size = remote.layout.full_chunk_bytes
    hot = [backend_key(i) for i in plan.get("hot", [])]
    stored = failed = hot_hits = hot_reads = 0

    def read_hot() -> None:
        nonlocal hot_hits, hot_reads
        if hot:
            got = backend.batched_get(hot)
            hot_reads += len(hot)
            hot_hits += sum(c is not None and bytes(c[:8]) == backend_chunk(i, 8)
                            for i, c in zip(plan["hot"], got, strict=True))

    try:
        assert remote._fleet is not None and remote._fleet.fleet.wait_ready(60)
        t0 = time.monotonic()
        batch = plan.get("batch", 4)
        for salt, first, count in plan["writes"]:
            for i in range(first, first + count, batch):
                ids = range(i, min(i + batch, first + count))
                items = [(backend_key(j, salt), backend_chunk(j, size)) for j in ids]
                results = backend.batched_put_results(items)
                stored += sum(r is None for r in results)
                failed += sum(r is not None for r in results)
                read_hot()
                time.sleep(plan.get("pause", 0.0))
        written = time.monotonic()
        end = written + plan.get("linger", 30.0)
        while sum(chunk_bytes(remote).values()) > plan["settle_bytes"] and time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        settled = time.monotonic() - written
        end = time.monotonic() + plan.get("after", 0.0)
        while time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        status = backend.report_status()
        out.put({"node": plan.get("name"), "status": status, "stored": stored, "failed": failed,
                 "hot_hits": hot_hits, "hot_reads": hot_reads, "write_secs": written - t0,
                 "settle_secs": settled})
    except BaseException as e:  # report, never hang the parent
        out.put({"node": plan.get("name"), "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        backend.close()


__all__ = ["LAYOUT", "MODEL", "backend_chunk", "backend_key", "chunk_bytes", "remote_tier",
           "run_backend_node"]
