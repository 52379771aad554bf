"""One fleet node in its own process, for the multi-process fleet tests and bench_fleet.py.

Run with ``multiprocessing.get_context("spawn")`` (obstore is not fork-safe): each process
opens its own L2 adapter on the shared prefix (:func:`run_node`), or joins as an engine tier
does (:func:`run_engine_node`), writes its own chunks, keeps reading a hot set every node shares,
and reports what it saw. Plans are plain dicts so they pickle.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
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
    between batches) or ``period`` (seconds from one batch's start to the next: a steady rate),
    ``linger`` (seconds to keep reading the hot set after writing), ``warm`` (seconds after which
    the fleet's counters are taken once more: the report's ``warm_fleet``, for a steady window),
    ``die_in_delete`` (SIGKILL itself halfway through its first eviction delete)."""
    from kvbucket.l2 import open_l2_adapter
    from kvbucket.testing import l2 as t

    adapter = open_l2_adapter(spec)
    size = plan["chunk"]
    hot = [key(i, plan.get("hot_salt", "")) for i in plan.get("hot", [])]
    hot_hits = hot_reads = stored = 0
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

        period = plan.get("period")  # seconds per batch (a steady rate), else "pause" between
        warm_fleet: dict[str, Any] | None = None
        warm_at = t0 + plan.get("warm", 0.0)
        for k, i in enumerate(range(start, start + count, batch)):
            if warm_fleet is None and time.monotonic() >= warm_at:
                warm_fleet = dict(adapter.report_status()["fleet"], at=time.monotonic() - t0)
            ids = list(range(i, min(i + batch, start + count)))
            r = t.store(adapter, [key(j, plan.get("salt", "")) for j in ids], [chunk(j, size) for j in ids])
            stored += sum(r.landed)
            read_hot()
            if period:
                time.sleep(max(0.0, t0 + (k + 1) * period - time.monotonic()))
            else:
                time.sleep(plan.get("pause", 0.0))
        written = time.monotonic() - t0
        end = time.monotonic() + plan.get("linger", 0.0)
        while time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        status = adapter.report_status()
        out.put({"node": plan.get("name"), "status": status, "hot_hits": hot_hits, "hot_reads": hot_reads,
                 "write_secs": written, "run_secs": time.monotonic() - t0,
                 "stored": stored, "data_requests": stored + hot_hits, "warm_fleet": warm_fleet})
    except BaseException as e:  # report, never hang the parent
        out.put({"node": plan.get("name"), "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        adapter.close()


def engine_name(engine: str, i: int, salt: str = "", size: int = 2048) -> str:
    """Chunk ``i``'s object name in an engine tier's scheme (SGLang page or vLLM chunk)."""
    from kvbucket.integrations.naming import salt_segment

    model, seg = "org--fleet-model", salt_segment(salt, engine)
    if engine == "sglang":
        return f"sglang/{model}/{seg}/tp0of1/layer_first-bfloat16-p16-b{size}/{i:064x}"
    return f"vllm/{model}/{seg}/anytp-0123456789abcdef/{i:064x}-g0"


def run_engine_node(spec: dict[str, Any], plan: dict[str, Any], out: Any) -> None:
    """A node as an engine tier takes part (:mod:`kvbucket.integrations.engine_fleet`): admit, store
    through the sealed store, note stored; loads note accessed; forgets what the fleet deletes.

    ``spec``: the tier's fleet keys plus ``root`` (a directory store). ``plan``: ``engine``,
    ``writes`` (``[salt, first, count]`` runs), ``chunk``, ``batch``, ``pause``, ``hot`` (chunk
    numbers of this node's first run, read after every batch), ``settle_bytes`` (linger, reading
    the hot set, until the store's chunks are at most this many bytes; at most ``linger`` s;
    then ``after`` s more)."""
    from kvbucket.fleet.layout import is_fleet_name
    from kvbucket.integrations.engine_fleet import FleetSettings, open_fleet
    from kvbucket.stores.guard.sealed import seal_store
    from kvbucket.stores.local.file import FileStore

    engine, size = plan["engine"], plan["chunk"]
    raw = FileStore(spec["root"])
    chunks = seal_store(raw, tier=engine)
    gone: list[str] = []
    fleet = open_fleet(FleetSettings.model_validate({k: v for k, v in spec.items() if k != "root"}),
                       raw, chunks, gone.extend)
    assert fleet is not None
    first_salt = plan["writes"][0][0]
    hot = [engine_name(engine, i, first_salt, size) for i in plan.get("hot", [])]
    stored = refused = hot_hits = 0

    def read_hot() -> None:
        nonlocal hot_hits
        if hot:
            found = [r.name for r in chunks.get_many(hot) if r.found]
            fleet.accessed(found)
            hot_hits += len(found)

    def used() -> int:
        return sum(i.size for i in chunks.list("") if not is_fleet_name(i.name, ""))

    try:
        assert fleet.fleet.wait_ready(30)
        for salt, first, count in plan["writes"]:
            for i in range(first, first + count, plan.get("batch", 4)):
                ids = range(i, min(i + plan.get("batch", 4), first + count))
                kept = fleet.admit([size] * len(ids))
                refused += len(ids) - kept
                items = [(engine_name(engine, j, salt, size), chunk(j, size)) for j in list(ids)[:kept]]
                landed = [r.name for r in chunks.put_many(items) if r.ok] if items else []
                fleet.stored(landed, [size] * len(landed))
                stored += len(landed)
                read_hot()
                time.sleep(plan.get("pause", 0.0))
        end = time.monotonic() + plan.get("linger", 20.0)
        while used() > plan["settle_bytes"] and time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        end = time.monotonic() + plan.get("after", 0.0)  # hear of the others' last deletes
        while time.monotonic() < end:
            read_hot()
            time.sleep(0.2)
        out.put({"node": plan.get("name"), "status": fleet.status(), "stored": stored, "refused": refused,
                 "hot_hits": hot_hits, "gone": len(gone)})
    except BaseException as e:  # report, never hang the parent
        out.put({"node": plan.get("name"), "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        fleet.close()
        chunks.close()


def run_paced_node(spec: dict[str, Any], plan: dict[str, Any], out: Any) -> None:
    """A node of the activity-paced fleet tests (``coordination_ratio``): it stores its own
    ``hot`` chunks, then for ``secs`` every ``tick`` seconds loads them (data requests), stores
    one chunk of ``writes`` every ``store_every`` seconds (its wall-clock time recorded), and
    looks up the chunks of ``watch`` it has not seen yet, loading the hits (first-hit time
    recorded). ``idle``: after storing its hot set it serves nothing. The fleet's own counters
    are reported at ``warm`` seconds and at the end (the busy window)."""
    from kvbucket.l2 import open_l2_adapter
    from kvbucket.testing import l2 as t

    adapter = open_l2_adapter(spec)
    size, tick = plan["chunk"], plan.get("tick", 0.1)
    hot = [key(i) for i in plan.get("hot", [])]
    writes, watch = list(plan.get("writes", [])), {key(i): i for i in plan.get("watch", [])}
    stored_at: dict[int, float] = {}
    seen_at: dict[int, float] = {}

    def counters() -> dict[str, Any]:
        f = adapter.report_status()["fleet"]
        return {k: f[k] for k in ("coordination_requests", "data_requests", "sync_interval_secs",
                                  "journals_written", "digests_read", "listing_rounds")}

    def load(keys: list[ObjectKey]) -> list[ObjectKey]:
        hits = [k for k, h in zip(keys, t.lookup(adapter, keys), strict=True) if h]
        if hits:
            ok = t.load(adapter, hits, [bytearray(size) for _ in hits])
            adapter.submit_unlock(hits)
            hits = [k for k, good in zip(hits, ok, strict=True) if good]
        return hits

    try:
        adapter.wait_until_rebuilt(60)
        if hot:
            data = [chunk(int.from_bytes(k.chunk_hash, "big"), size) for k in hot]
            assert t.store(adapter, hot, data).success
        t0 = time.monotonic()
        warm: dict[str, Any] | None = None
        next_store = t0 + plan.get("store_from", 0.0)
        k = 0
        stall, last = 0.0, t0
        while (now := time.monotonic()) < t0 + plan["secs"]:
            stall, last = max(stall, now - last), now
            if warm is None and now >= t0 + plan.get("warm", 0.0):
                warm = counters()
            if not plan.get("idle"):
                load(hot)
                if writes and now >= next_store:
                    i = writes.pop(0)
                    if t.store(adapter, [key(i)], [chunk(i, size)]).success:
                        stored_at[i] = time.time()
                    next_store += plan["store_every"]
                todo = [kk for kk in watch if watch[kk] not in seen_at]
                for kk in load(todo) if todo else []:
                    seen_at[watch[kk]] = time.time()
            k += 1
            time.sleep(max(0.0, t0 + k * tick - time.monotonic()))
        out.put({"node": plan.get("name"), "warm": warm, "end": counters(), "stored_at": stored_at,
                 "seen_at": seen_at, "ended": time.time(), "status": adapter.report_status(),
                 "stall": max(stall, time.monotonic() - last), "hot_hits_at_end": sum(t.lookup(adapter, hot))
                 if hot and not plan.get("idle") else None})
    except BaseException as e:  # report, never hang the parent
        out.put({"node": plan.get("name"), "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        adapter.close()


def paced_fleet(spec: dict[str, Any], fleet: dict[str, Any], *, chunk_bytes: int = 4096,
                secs: float = 20.0, warm: float = 5.0, hot: int = 8, tick: float = 0.1,
                store_every: float = 0.5) -> dict[str, Any]:
    """Four processes on one prefix with an activity-paced ``fleet`` config: ``a-compactor``
    (the smallest id), a writer ``w`` and a reader ``r`` each load their ``hot`` chunks every
    ``tick``; ``w`` stores a new chunk every ``store_every`` from ``warm`` on and ``r`` watches
    for them; ``z-idle`` serves nothing after storing one chunk. Returns, for the busy window
    (``warm`` to the end): per node the fleet's coordination and data request deltas, the last
    sync interval, and the writer-to-reader visibility lags of the chunks stored at least
    ``max_sync_secs`` before the reader stopped (``unseen``: those never seen)."""
    names = ["a-compactor", "w", "r", "z-idle"]
    writes = list(range(5000, 5000 + int(secs / store_every) + 1))
    base = {"chunk": chunk_bytes, "secs": secs, "warm": warm, "tick": tick}
    plans = [
        {**base, "name": "a-compactor", "hot": list(range(100, 100 + hot))},
        {**base, "name": "w", "hot": list(range(200, 200 + hot)), "writes": writes,
         "store_every": store_every, "store_from": warm},
        {**base, "name": "r", "hot": list(range(300, 300 + hot)), "watch": writes},
        {**base, "name": "z-idle", "hot": [400], "idle": True},
    ]
    specs = [{**spec, "full_chunk_bytes": chunk_bytes, "fleet": {**fleet, "node_id": n}} for n in names]
    reports = {r["node"]: r for r in run_fleet(specs, plans, timeout=secs + 120, target=run_paced_node)}
    bound = fleet.get("max_sync_secs", 60.0)
    stored, seen, ended = reports["w"]["stored_at"], reports["r"]["seen_at"], reports["r"]["ended"]
    due = [i for i, at in stored.items() if at <= ended - bound]
    nodes = {n: {"coordination": r["end"]["coordination_requests"] - r["warm"]["coordination_requests"],
                 "data": r["end"]["data_requests"] - r["warm"]["data_requests"],
                 "interval": r["end"]["sync_interval_secs"], "compactor": r["status"]["fleet"]["compactor"],
                 "stall": round(r["stall"], 2), "hot_hits_at_end": r["hot_hits_at_end"]}
             for n, r in reports.items()}
    return {"nodes": nodes, "lags": sorted(seen[i] - stored[i] for i in due if i in seen),
            "unseen": [i for i in due if i not in seen], "stored": len(stored), "window": secs - warm}


def check_paced(r: dict[str, Any], fleet: dict[str, Any]) -> None:
    """Assert what an activity-paced fleet promises (:mod:`kvbucket.fleet.pacing`) on
    :func:`paced_fleet`'s report: (a) visibility within ``max_sync_secs``, (b) coordination
    within ``coordination_ratio`` of data requests once busy, (c) the idle node backed off."""
    from kvbucket.fleet.pacing import CREDIT_CAP, ROUND_COST

    print(r)
    ratio, bound, slack = fleet["coordination_ratio"], fleet["max_sync_secs"], CREDIT_CAP + ROUND_COST
    nodes = r["nodes"]
    # (a) every chunk the writer stored is a hit on the reader within max_sync_secs.
    assert r["stored"] >= 5 and not r["unseen"], r["unseen"]
    assert r["lags"] and max(r["lags"]) <= bound, r["lags"]
    busy = [n for n in ("a-compactor", "w", "r") if n in nodes]
    # "stall": the longest step of a node's loop (a load that hung shows here).
    assert nodes["a-compactor"]["compactor"] and all(nodes[n]["data"] > 0 for n in busy), nodes
    # (b) a busy node other than the compactor stays within the ratio by its own counters; the
    # compactor reads and deletes the others' journals (paid by their writers), so the busy
    # fleet as a whole stays within it too.
    for n in ("w", "r"):
        assert nodes[n]["coordination"] <= ratio * nodes[n]["data"] + slack, (n, nodes[n])
    coord, data = sum(nodes[n]["coordination"] for n in busy), sum(nodes[n]["data"] for n in busy)
    assert coord <= ratio * data + slack * len(busy), (coord, data)
    # (c) the node that serves nothing backed off to idle_sync_secs: per idle round a digest
    # read, a heartbeat and perhaps a new snapshot, not two requests every stage.
    idle = nodes["z-idle"]
    assert idle["data"] == 0 and idle["interval"] == fleet["idle_sync_secs"], idle
    stage_rounds = r["window"] / (bound / 4)
    assert idle["coordination"] <= 3 * (r["window"] / fleet["idle_sync_secs"] + 1) < 2 * stage_rounds, idle


def until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass (fleet news arrives in rounds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


__all__ = [
    "check_paced",
    "chunk",
    "engine_name",
    "key",
    "paced_fleet",
    "run_engine_node",
    "run_fleet",
    "run_node",
    "run_paced_node",
    "until",
]


def run_fleet(
    specs: list[dict[str, Any]], plans: list[dict[str, Any]], timeout: float = 120.0,
    target: Any = run_node,
) -> list[dict[str, Any]]:
    """Run one spawned process per (spec, plan) with ``target`` (:func:`run_node` or
    :func:`run_engine_node`) and return the reports of those that were not told to die; raises
    AssertionError naming what went wrong."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(s, p, out)) for s, p in zip(specs, plans, strict=True)]
    for p in procs:
        p.start()
    reports: list[dict[str, Any]] = []
    expected = sum(1 for p in plans if not p.get("die_in_delete"))
    end = time.monotonic() + timeout
    while len(reports) < expected and time.monotonic() < end:
        try:
            reports.append(out.get(timeout=1.0))
        except queue.Empty:
            continue
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert len(reports) == expected, reports
    errors = [r for r in reports if "error" in r]
    assert not errors, errors
    return reports
