"""kvbucket's S3Store vs LMCache 0.5.6's awscrt S3L2Adapter vs boto3, against one SeaweedFS server.

    PYTHONPATH=src python benchmarks/bench_s3.py            # 256 x 2 MiB, 3 rounds, 64 I/O threads

For each client and round: **store** N chunks (one batch), **lookup** 1,000 keys (the N stored
plus absent ones) from a freshly opened client (LMCache's adapter caches sizes of what it stored,
so a warm instance would skip the HEADs), then **load** the N chunks into preallocated buffers
(LMCache: its TensorMemoryObj; kvbucket: numpy arrays via get_many(out=...); boto3: readinto).
Loads are verified byte for byte outside the timed region. S3Store does nothing at lookup time
for the load to come (read-ahead lives in the tiers and adapters in front of a store, not in the
store), so its lookup and load are honest apart here; through LMCache's runner, with read-ahead,
see bench_l2.py. Figures are the median of the rounds;
client order rotates every round so drift on a shared machine hits everyone alike. CPU is the
benchmark process's CPU time (the server runs in its own process).

Pointing LMCache at a local server: its adapter only does virtual-hosted requests (the Host
header is ``s3_endpoint``; LMCache issue #3376). SeaweedFS is started with
``-s3.domainName=0.0.1``, so the Host ``127.0.0.1:PORT`` reads as bucket ``127`` on domain
``0.0.1`` while still being an IP that needs no DNS. kvbucket uses the same virtual-hosted bare
host form (``s3_endpoint: 127.0.0.1:PORT``); boto3 uses path-style through ``localhost:PORT``
(a name outside the domain, so it is not read as a bucket). All three use plain HTTP, HTTP/1.1,
static credentials and SigV4; kvbucket and LMCache send UNSIGNED-PAYLOAD bodies (awscrt's default
for its S3 client; kvbucket's ``s3_unsigned_payload: true``), boto3 signs payloads over HTTP.
"""

from __future__ import annotations

import argparse
import gc
import os
import select
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import SeaweedFS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument

BUCKET = "127"
MiB = 1024 * 1024


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (the server)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Timer:
    """Wall time, this process's CPU time and the server's CPU time of a block."""

    server_pid = 0

    def __init__(self) -> None:
        self.wall = self.cpu = self.server_cpu = 0.0

    def __enter__(self) -> Timer:
        gc.collect()
        # Write back what earlier phases left dirty in the page cache now, so the kernel's
        # flusher threads do not take CPU from whichever client happens to be timed ~30 s later.
        os.sync()
        self._s = proc_cpu(self.server_pid) if self.server_pid else 0.0
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._w
        self.cpu = time.process_time() - self._c
        self.server_cpu = (proc_cpu(self.server_pid) - self._s) if self.server_pid else 0.0


# ---- clients: each exposes store(chunks), lookup(keys) -> hits, load(into) -----------------


class KvbucketClient:
    name = "kvbucket S3Store"

    def __init__(self, port: int, access: str, secret: str, threads: int, prefix: str) -> None:
        self.cfg = S3Config.parse(
            {
                "s3_endpoint": f"127.0.0.1:{port}/{prefix}",  # bucket "127" on domain "0.0.1"
                "disable_tls": True,
                "s3_region": "us-east-1",
                "s3_num_io_threads": threads,
                "aws_access_key_id": access,
                "aws_secret_access_key": secret,
                "s3_unsigned_payload": True,
            }
        )
        self.store = S3Store(self.cfg)

    def reopen(self) -> None:
        self.store.close()
        self.store = S3Store(self.cfg)

    def store_all(self, names: list[str], chunks: list[np.ndarray]) -> int:
        return sum(r.ok for r in self.store.put_many(list(zip(names, chunks, strict=True))))

    def lookup(self, names: list[str]) -> int:
        return sum(r.found for r in self.store.head_many(names))

    def load(self, names: list[str], outs: list[np.ndarray]) -> int:
        return sum(r.found for r in self.store.get_many(names, outs))

    def close(self) -> None:
        self.store.close()


class Boto3Client:
    name = "boto3 + thread pool"

    def __init__(self, port: int, access: str, secret: str, threads: int, prefix: str) -> None:
        import boto3
        from botocore.config import Config

        self.prefix = prefix
        self.threads = threads
        self._make = lambda: boto3.client(
            "s3",
            endpoint_url=f"http://localhost:{port}",
            aws_access_key_id=access,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(max_pool_connections=threads, s3={"addressing_style": "path"}),
        )
        self.client = self._make()
        self.pool = ThreadPoolExecutor(threads)

    def reopen(self) -> None:
        self.client = self._make()

    def _map(self, fn: Callable[..., Any], *its: Any) -> list[Any]:
        return list(self.pool.map(fn, *its))

    def store_all(self, names: list[str], chunks: list[np.ndarray]) -> int:
        def put(n: str, c: np.ndarray) -> bool:
            self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{n}", Body=c.tobytes())
            return True

        return sum(self._map(put, names, chunks))

    def lookup(self, names: list[str]) -> int:
        from botocore.exceptions import ClientError

        def head(n: str) -> bool:
            try:
                self.client.head_object(Bucket=BUCKET, Key=f"{self.prefix}/{n}")
                return True
            except ClientError as e:
                if e.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

        return sum(self._map(head, names))

    def load(self, names: list[str], outs: list[np.ndarray]) -> int:
        def get(n: str, out: np.ndarray) -> bool:
            body = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{n}")["Body"]
            view = memoryview(out).cast("B")
            got = 0
            while got < len(view):
                k = body.readinto(view[got:])
                if not k:
                    break
                got += k
            return got == len(view)

        return sum(self._map(get, names, outs))

    def close(self) -> None:
        self.pool.shutdown()


class LMCacheClient:
    name = "LMCache S3L2Adapter (awscrt)"

    def __init__(self, port: int, access: str, secret: str, threads: int, prefix: str) -> None:
        import torch
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.distributed.l2_adapters.s3_l2_adapter import S3L2Adapter, S3L2AdapterConfig
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        self.torch, self.ObjectKey, self.Adapter = torch, ObjectKey, S3L2Adapter
        self.TensorMemoryObj, self.Meta, self.fmt = TensorMemoryObj, MemoryObjMetadata, MemoryFormat.KV_2LTD
        self.model = prefix
        self.cfg = S3L2AdapterConfig.from_dict(
            {
                "s3_endpoint": f"127.0.0.1:{port}",  # Host header: bucket "127" on domain "0.0.1"
                "s3_region": "us-east-1",
                "s3_num_io_threads": threads,
                "s3_prefer_http2": False,
                "disable_tls": True,
                "aws_access_key_id": access,
                "aws_secret_access_key": secret,
            }
        )
        self.adapter = S3L2Adapter(self.cfg)

    def reopen(self) -> None:
        self.adapter.close()
        self.adapter = self.Adapter(self.cfg)

    def _key(self, name: str) -> Any:
        return self.ObjectKey(chunk_hash=bytes.fromhex(name), model_name=self.model, kv_rank=0)

    def _obj(self, arr: np.ndarray) -> Any:
        t = self.torch.from_numpy(arr)  # shares memory with the numpy buffer
        meta = self.Meta(
            shape=t.shape,
            dtype=t.dtype,
            address=0,
            phy_size=t.nbytes,
            ref_count=1,
            fmt=self.fmt,
            shapes=[t.shape],
            dtypes=[t.dtype],
        )
        return self.TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)

    @staticmethod
    def _wait(fd: int, poll: Callable[[], Any]) -> Any:
        while True:
            result = poll()
            if result is not None:
                return result
            ready, _, _ = select.select([fd], [], [], 60)
            if not ready:
                raise TimeoutError("LMCache adapter task did not finish in 60 s")
            os.eventfd_read(fd)

    def store_all(self, names: list[str], chunks: list[np.ndarray]) -> int:
        objs = [self._obj(c) for c in chunks]
        task = self.adapter.submit_store_task([self._key(n) for n in names], objs)
        done = self._wait(
            self.adapter.get_store_event_fd(),
            lambda: self.adapter.pop_completed_store_tasks().get(task),
        )
        return len(names) if int(done) >= 0 else 0  # L2StoreResult: -1 = failure

    def lookup(self, names: list[str]) -> int:
        keys = [self._key(n) for n in names]
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        bitmap = self._wait(
            self.adapter.get_lookup_and_lock_event_fd(),
            lambda: self.adapter.query_lookup_and_lock_result(task),
        )
        self.adapter.submit_unlock(keys)
        return sum(bitmap.test(i) for i in range(len(keys)))

    def load(self, names: list[str], outs: list[np.ndarray]) -> int:
        objs = [self._obj(o) for o in outs]
        task = self.adapter.submit_load_task([self._key(n) for n in names], objs)
        bitmap = self._wait(self.adapter.get_load_event_fd(), lambda: self.adapter.query_load_result(task))
        return sum(bitmap.test(i) for i in range(len(names)))

    def close(self) -> None:
        self.adapter.close()


class ObstoreAsyncClient(KvbucketClient):
    """The alternative kvbucket did not take: obstore's async API on one asyncio loop (same client
    settings as S3Store, a semaphore of ``s3_num_io_threads`` requests in flight)."""

    name = "obstore async (not used)"

    def _gather(self, make: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        import asyncio

        async def run() -> list[Any]:
            sem = asyncio.Semaphore(self.cfg.s3_num_io_threads)

            async def one(item: Any) -> Any:
                async with sem:
                    return await make(item)

            return await asyncio.gather(*(one(i) for i in items))

        return asyncio.run(run())

    def store_all(self, names: list[str], chunks: list[np.ndarray]) -> int:
        import obstore

        store = self.store._store

        async def put(item: tuple[str, np.ndarray]) -> bool:
            await obstore.put_async(store, item[0], memoryview(item[1]))
            return True

        return sum(self._gather(put, list(zip(names, chunks, strict=True))))

    def lookup(self, names: list[str]) -> int:
        import obstore

        store = self.store._store

        async def head(n: str) -> bool:
            try:
                await obstore.head_async(store, n)
                return True
            except FileNotFoundError:
                return False

        return sum(self._gather(head, names))

    def load(self, names: list[str], outs: list[np.ndarray]) -> int:
        import obstore

        store = self.store._store

        async def get(item: tuple[str, np.ndarray]) -> bool:
            r = await obstore.get_async(store, item[0])
            data = await r.bytes_async()
            memoryview(item[1])[:] = data
            return True

        return sum(self._gather(get, list(zip(names, outs, strict=True))))


CLIENTS = {
    "kvbucket": KvbucketClient,
    "lmcache": LMCacheClient,
    "boto3": Boto3Client,
    "obstore-async": ObstoreAsyncClient,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--io-threads", type=int, default=64, help="s3_num_io_threads / pool size for every client"
    )
    ap.add_argument("--clients", default="kvbucket,lmcache,boto3", help="also: obstore-async")
    ap.add_argument(
        "--server-cache-mb",
        type=int,
        default=0,
        help="SeaweedFS -s3.cacheCapacityMB (in-memory GET cache; 0 = off, its default)",
    )
    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_s3", params=vars(args),
                  title="S3Store vs LMCache 0.5.6's S3 adapter (awscrt) and boto3, SeaweedFS")

    # LMCache's client allocates and fills torch tensors; torch's OpenMP workers then spin-wait,
    # taking a core from the server and the clients on a small machine. Same for every client.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    size = int(args.chunk_mib * MiB)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.chunks)]
    outs = [np.empty(size, dtype=np.uint8) for _ in range(args.chunks)]
    total = args.chunks * size
    names = [f"{i:016x}" for i in range(args.chunks)]
    absent = [f"{0xF000000000000000 + i:016x}" for i in range(max(0, args.lookups - args.chunks))]
    lookup_names = (names + absent)[: args.lookups]
    expect_hits = min(args.chunks, args.lookups)
    chosen = [c.strip() for c in args.clients.split(",") if c.strip()]

    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        c: {"store": [], "lookup": [], "load": []} for c in chosen
    }
    print(
        f"S3 benchmark: {args.chunks} x {args.chunk_mib:g} MiB chunks ({total / MiB:.0f} MiB), "
        f"{args.lookups} lookups ({expect_hits} hits), {args.rounds} rounds, {args.io_threads} I/O threads, "
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); SeaweedFS (weed mini) on 127.0.0.1, "
        f"GET cache {args.server_cache_mb} MB",
        flush=True,
    )
    extra = (f"-s3.cacheCapacityMB={args.server_cache_mb}",) if args.server_cache_mb else ()
    weed = SeaweedFS(domain_name="0.0.1", client_host="localhost", extra_args=extra)
    server = weed.start()
    assert weed.proc is not None
    Timer.server_pid = weed.proc.pid
    try:
        server.create_bucket(BUCKET)
        for rnd in range(args.rounds):
            order = chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]
            for cname in order:
                prefix = f"{cname}-r{rnd}"
                client = CLIENTS[cname](
                    server.port, server.access_key, server.secret_key, args.io_threads, prefix
                )
                try:
                    with Timer() as t:
                        stored = client.store_all(names, chunks)
                    assert stored == args.chunks, f"{cname}: stored {stored}/{args.chunks}"
                    results[cname]["store"].append((t.wall, t.cpu, t.server_cpu))
                    client.reopen()  # cold: no size cache from the store phase
                    with Timer() as t:
                        hits = client.lookup(lookup_names)
                    assert hits == expect_hits, f"{cname}: {hits} lookup hits, expected {expect_hits}"
                    results[cname]["lookup"].append((t.wall, t.cpu, t.server_cpu))
                    for o in outs:
                        o.fill(0)
                    with Timer() as t:
                        loaded = client.load(names, outs)
                    assert loaded == args.chunks, f"{cname}: loaded {loaded}/{args.chunks}"
                    results[cname]["load"].append((t.wall, t.cpu, t.server_cpu))
                    bad = [i for i in range(args.chunks) if not np.array_equal(outs[i], chunks[i])]
                    assert not bad, f"{cname}: {len(bad)} chunks loaded wrong, first {bad[0]}"
                finally:
                    client.close()
                print(f"  round {rnd + 1} {cname}: ok", flush=True)
            # Free the server's disk between rounds.
            c = server.client()
            for cname in chosen:
                for page in c.get_paginator("list_objects_v2").paginate(
                    Bucket=BUCKET, Prefix=f"{cname}-r{rnd}/"
                ):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    if keys:
                        c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
            if "lmcache" in chosen:  # LMCache's keys are <model>@..., not under a "/" prefix
                for page in c.get_paginator("list_objects_v2").paginate(
                    Bucket=BUCKET, Prefix=f"lmcache-r{rnd}@"
                ):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    if keys:
                        c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
    finally:
        weed.stop()

    def med(xs: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds")
    print(
        f"{'client':<30} {'store MiB/s':>12} {'lookup ms':>10} {'load MiB/s':>11} "
        f"{'client CPU s st/lk/ld':>22} {'server CPU s st/lk/ld':>22}"
    )
    rows: dict[str, dict[str, float]] = {}
    for cname in chosen:
        r = results[cname]
        row = {
            "store": total / MiB / med(r["store"], 0),
            "lookup": med(r["lookup"], 0) * 1000,
            "load": total / MiB / med(r["load"], 0),
        }
        rows[cname] = row
        cpu = "/".join(f"{med(r[p], 1):.2f}" for p in ("store", "lookup", "load"))
        scpu = "/".join(f"{med(r[p], 2):.2f}" for p in ("store", "lookup", "load"))
        print(
            f"{CLIENTS[cname].name:<30} {row['store']:>12.0f} {row['lookup']:>10.0f} {row['load']:>11.0f} "
            f"{cpu:>22} {scpu:>22}"
        )
    print("\nper-round wall seconds (store / lookup / load), in run order:")
    for cname in chosen:
        r = results[cname]
        spans = "  ".join(
            f"{r['store'][i][0]:.1f}/{r['lookup'][i][0]:.2f}/{r['load'][i][0]:.2f}"
            for i in range(len(r["store"]))
        )
        print(f"  {cname:<9} {spans}")
    if "kvbucket" in rows:
        print()
        k = rows["kvbucket"]
        for other, goal_load in (("lmcache", 1.3), ("boto3", 1.5)):
            if other not in rows:
                continue
            o = rows[other]
            load_ratio = k["load"] / o["load"]
            store_ratio = k["store"] / o["store"]
            lookup_ratio = o["lookup"] / k["lookup"]
            print(
                f"kvbucket vs {other:<8} load x{load_ratio:.2f} (goal >= {goal_load}: "
                f"{'met' if load_ratio >= goal_load else 'NOT met'}), store x{store_ratio:.2f} "
                f"(goal >= 1.0: {'met' if store_ratio >= 1.0 else 'NOT met'}), lookup x{lookup_ratio:.2f}"
            )
    record(res, args, results, chosen, total)
    res.write(args.results_dir)
    return 0


Rounds = dict[str, dict[str, list[tuple[float, float, float]]]]  # client -> op -> (wall, cpu, server cpu)


def record(res: Results, args: argparse.Namespace, results: Rounds, chosen: list[str], total: int) -> None:
    """Per-round (wall, client CPU, server CPU) of every client; kvbucket against each peer."""
    for cname in chosen:
        for op, samples in results[cname].items():
            for i, (wall, cpu, scpu) in enumerate(samples):
                res.run(client=cname, op=op, round=i + 1, wall_s=wall, cpu_s=cpu, server_cpu_s=scpu)
    if "kvbucket" not in chosen:
        return
    k = results["kvbucket"]
    mib = total / MiB
    shape = f"{args.chunks} x {args.chunk_mib:g} MiB"
    for other, goal_load in (("lmcache", 1.3), ("boto3", 1.5)):
        if other not in chosen:
            continue
        o = results[other]
        for op, label, amount, unit, goal in (
            ("load", f"load ({shape})", mib, "MiB/s", goal_load),
            ("store", f"store ({shape})", mib, "MiB/s", 1.0),
            ("lookup", f"lookup ({args.lookups:,} keys)", args.lookups, "keys/s", None),
        ):
            kw = statistics.median(x[0] for x in k[op])
            ow = statistics.median(x[0] for x in o[op])
            res.compare(f"{op} vs {other}", label, ours=amount / kw, peer=amount / ow,
                        peer_name=CLIENTS[other].name, unit=unit,
                        goal=None if goal is None else f">= {goal}",
                        cpu_s=statistics.median(x[1] for x in k[op]),
                        peer_cpu_s=statistics.median(x[1] for x in o[op]),
                        ratios=[b[0] / a[0] for a, b in zip(k[op], o[op], strict=True)])


if __name__ == "__main__":
    sys.exit(main())
