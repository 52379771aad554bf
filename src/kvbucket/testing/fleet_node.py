"""One fleet node in its own process, for the multi-process fleet tests and bench_fleet.py.

Run with ``multiprocessing.get_context("spawn")`` (obstore is not fork-safe): each process
opens its own L2 adapter on the shared prefix, writes its own chunks, keeps reading a hot set
every node shares, and reports what it saw. Plans are plain dicts so they pickle.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from kvbucket.keys import ObjectKey

MODEL = "org/fleet-model"


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(MODEL, 0x01000100, i.to_bytes(8, "big"), salt)


def chunk(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "big") * (size // 8 + 1))[:size]


def run_node(spec: dict[str, Any], plan: dict[str, Any], out: Any) -> None:
    """``plan``: ``start``/``count`` (this node's chunk numbers), ``salt``, ``chunk`` (bytes),
    ``batch``, ``hot`` (chunk numbers every node reads, salt ``hot_salt``), ``pause`` (seconds
    between batches), ``linger`` (seconds to keep reading the hot set after writing),
    ``die_in_delete`` (SIGKILL itself halfway through its first eviction delete)."""
    from kvbucket.l2 import open_l2_adapter
    from kvbucket.testing import l2 as t

    adapter = open_l2_adapter(spec)
    size = plan["chunk"]
    hot = [key(i, plan.get("hot_salt", "")) for i in plan.get("hot", [])]
    hot_hits = hot_reads = 0
    if plan.get("die_in_delete"):
        store = adapter.store
        inner = store.delete_many

        def dying_delete(names: Any) -> Any:
            names = list(names)
            inner(names[: max(1, len(names) // 2)])
            os.kill(os.getpid(), signal.SIGKILL)

        store.delete_many = dying_delete  # type: ignore[method-assign]
    try:
        adapter.wait_until_rebuilt(60)
        start, count, batch = plan["start"], plan["count"], plan.get("batch", 8)
        t0 = time.monotonic()

        def read_hot() -> None:
            nonlocal hot_hits, hot_reads
            if not hot:
                return
            hits = t.lookup(adapter, hot)
            hot_reads += len(hot)
            locked = [k for k, h in zip(hot, hits, strict=True) if h]
            if locked:
                bufs = [bytearray(size) for _ in locked]
                ok = t.load(adapter, locked, bufs)
                hot_hits += sum(ok)
                adapter.submit_unlock(locked)

        for i in range(start, start + count, batch):
            ids = list(range(i, min(i + batch, start + count)))
            t.store(adapter, [key(j, plan.get("salt", "")) for j in ids], [chunk(j, size) for j in ids])
            read_hot()
            time.sleep(plan.get("pause", 0.0))
        written = time.monotonic() - t0
        end = time.monotonic() + plan.get("linger", 0.0)
        while time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        status = adapter.report_status()
        out.put({"node": plan.get("name"), "status": status, "hot_hits": hot_hits, "hot_reads": hot_reads,
                 "write_secs": written})
    except BaseException as e:  # report, never hang the parent
        out.put({"node": plan.get("name"), "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        adapter.close()


__all__ = ["chunk", "key", "run_node"]
