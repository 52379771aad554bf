"""The per-process ceiling of a KV hit: client CPU and GIL-held seconds per GiB, by path and peer.

    PYTHONPATH=src python benchmarks/bench_ceiling.py [--backends s3,hub] [--sizes 2,8,32] \
        [--total-mib 512] [--payloads kv,random] [--rounds 2] [--sides ...] [--quick]

Why: on a GPU host with many cores, whatever holds Python's GIL in the engine's process is
serial and taken from the engine's own threads, so a load's bytes/s per process is bounded by
1 / (GIL-held seconds per GiB) however many cores there are (issue 30). Loopback wall time on
this 2-core machine, with the servers on the same cores, says little about that; CPU and GIL
seconds per GiB do.

For each backend (S3: SeaweedFS; Hub: the project's emulator, each in its own process) and each
object size (``--total-mib`` per set: 512 = 256 x 2, 64 x 8, 16 x 32 MiB), every side stores two
sets and loads them in a fresh process: the first set **cold** (new process: no connection, token
or metadata), the second **warm** (same process, a new prompt's names). A load is a lookup
(``head_many`` or the side's own) and a load into preallocated buffers, verified afterwards
(xxh3-128 of every object against the payload written). Figures per phase:

- client CPU s/GiB: ``getrusage(RUSAGE_SELF)`` user + system of the side's process (every thread,
  hf_xet's, libcurl's and awscrt's included), per GiB moved;
- GIL-held s/GiB: ``py-spy record --gil --nonblocking`` attached to that process for the phase
  only: the samples whose thread held the GIL, over the sampling rate. Why py-spy and not a
  spin-probe thread: py-spy reads which thread holds the GIL from the interpreter's memory, from
  outside, so it neither takes the GIL nor competes for it, and it is not fooled by a thread that
  waits for a core rather than for the GIL (this machine's two cores are shared with the servers:
  a probe's wake-up latency would count run-queue waits as GIL). Without py-spy (``pip install
  py-spy``; it needs ptrace rights) the GIL figures are left empty;
- projected ceiling = 1 / GIL-held, GiB/s per process (not GIL-bound: empty when no GIL was seen);
- cores: client CPU seconds over wall seconds (> 1: the load kept more than one core busy);
- who did the work (``ceiling_meters.CpuMeter``): each thread's CPU seconds and share, and its
  run-queue wait (``/proc/self/task/*/schedstat``), the server's cores (its process tree,
  ``/proc/<pid>/stat``) and the box's busy cores (``/proc/stat``: py-spy and anything else running
  are in it) over the same interval. On a 2-core box a client whose work is split over threads
  can still show < 1 core when the server takes the rest: the line says which it was.

Sides. S3: ``kvbucket-s3`` (a sealed ``S3Store``: ``head_many`` + ``get_many``, verified envelopes),
``obstore`` (``head`` + ``get`` in 16 threads, bytes copied into the buffers), ``boto3``
(``head_object`` + ``get_object`` ``readinto`` in 16 threads), ``lmcache-s3`` (LMCache 0.5.6's ``s3``
L2 adapter, awscrt). Hub: ``kvbucket-hub`` (a sealed ``HFBucketStore``), ``hf_xet-stream`` (the same
store reading through hf_xet's ``download_unordered_stream``, its bytes copied into the buffers),
``download_bucket_files`` (huggingface_hub: paths-info, then hf_xet writes files to /dev/shm, read
back into the buffers) and ``lmcache-hfbucket`` (LMCache 0.5.6's ``hfbucket`` L2 adapter, its
downloads in /dev/shm). Peers read raw objects (no envelope) stored by kvbucket's unsealed store;
kvbucket's and LMCache's sides also report their **stores** (cold and warm) the same way. LMCache's
adapters are driven as ``lmcache bench l2`` drives them (``benchmarks/lmcache_adapters.py``): one
store task, then lookup-and-lock + one load task into tensor views of the buffers + unlock.

Payloads: ``kv`` (realistic bf16 KV, :mod:`kvbucket.testing.payloads`) by default, ``random`` as
the second row. Rounds alternate the order of the sides; the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
SRC = str(BENCH.parent / "src")
sys.path.insert(0, str(BENCH))
sys.path.insert(0, SRC)
import lmcache_adapters as lmc  # noqa: E402
from ceiling_meters import measure, pyspy  # noqa: E402
from results import Results, add_argument  # noqa: E402

TOKEN = "hf_bench_ceiling_" + "0" * 16
#: kvbucket's S3 load of the objects ``kvbucket-s3`` stored, served by ``sendfile_s3.py`` (a read-only
#: stand-in that costs the box little per byte) instead of SeaweedFS: what the client alone can use.
SENDFILE = "kvbucket-s3@sendfile"
SIDES = {"s3": ("kvbucket-s3", "obstore", "boto3", "lmcache-s3", SENDFILE),
         "hub": ("kvbucket-hub", "hf_xet-stream", "download_bucket_files", "lmcache-hfbucket")}
#: Sides that store (and are timed storing); the others read what ``raw`` stored.
STORING = {"kvbucket-s3", "kvbucket-hub", "lmcache-s3", "lmcache-hfbucket"}
LMCACHE = {"lmcache-s3", "lmcache-hfbucket"}
PEER_THREADS = 16


def digest(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(memoryview(data).cast("B"))


# ---- payload sets ---------------------------------------------------------------------------
def names(spec: dict[str, Any], s: int) -> list[str]:
    return [f"{spec['kind']}-{spec['size'] >> 20}m-{spec['tag']}-s{s}-{i:04d}" for i in range(spec["n"])]


def set_payloads(spec: dict[str, Any], s: int) -> list[Any]:
    """Set ``s``'s objects, from the files the parent wrote (``np.memmap``: no copy made here)."""
    import numpy as np

    mm = np.memmap(spec["files"][s], dtype=np.uint8, mode="r")
    return [mm[i * spec["size"] : (i + 1) * spec["size"]] for i in range(spec["n"])]


# ---- children: one fresh process per side and round ----------------------------------------
def child(spec: dict[str, Any]) -> dict[str, Any]:
    nbytes, pid = spec["n"] * spec["size"], spec.get("server_pid")
    if spec["mode"] == "store":
        prepare, close = (_lmcache_storer if spec["side"] in LMCACHE else _kvbucket_storer)(spec)
        phases = []
        for s, phase in enumerate(("cold", "warm")):
            m = measure(prepare(s), nbytes, pid)
            m.pop("result")
            phases.append({"op": "store", "phase": phase, **m})
        close()
        return {"phases": phases if spec["side"] != "raw" else []}
    import numpy as np

    load = LOADERS[spec["side"]](spec)
    phases = []
    for s, phase in enumerate(("cold", "warm")):
        bufs = [np.empty(spec["size"], np.uint8) for _ in range(spec["n"])]
        for b in bufs:  # an engine's buffers are allocated and touched once (no page faults in a load)
            b.fill(0)
        m = measure(lambda s=s, bufs=bufs: load(names(spec, s), bufs), nbytes, pid)
        loaded = m.pop("result")
        phases.append({"op": "load", "phase": phase, "loaded": loaded, "digests": [digest(b) for b in bufs],
                       **m})
    return {"phases": phases}


Storer = tuple[Callable[[int], Callable[[], Any]], Callable[[], None]]


def _kvbucket_storer(spec: dict[str, Any]) -> Storer:
    """(set ``s`` -> its ``put_many``, close): kvbucket's sealed store, or ``raw`` (the peers' objects)."""
    store = open_kvbucket(spec, sealed=spec["side"] != "raw")

    def prepare(s: int) -> Callable[[], Any]:
        items = list(zip(names(spec, s), set_payloads(spec, s), strict=True))

        def put() -> None:
            bad = [str(r.error) for r in store.put_many(items) if not r.ok]
            assert not bad, bad[:2]
        return put
    return prepare, store.close


def lmcache_keys(spec: dict[str, Any], s: int) -> list[Any]:
    """Set ``s``'s keys for LMCache's adapters (ObjectKeys of LMCache's bench, a model name per setting)."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys

    model = f"ceiling-{spec['kind']}-{spec['size'] >> 20}m-{spec['tag']}"
    return make_object_keys(spec["n"], model_name=model, key_offset=s * spec["n"])


def _lmcache_storer(spec: dict[str, Any]) -> Storer:
    """(set ``s`` -> one store task of its objects, close): LMCache's adapter (``lmcache_adapters``).
    The objects are copied into the engine's memory (plain tensors, as its L1) before the timing."""
    import numpy as np
    import torch

    adapter = lmc.open_adapter(spec["lmcache"], spec.get("endpoint"))

    def prepare(s: int) -> Callable[[], Any]:
        objs = [lmc.memory_obj(torch.from_numpy(np.array(p))) for p in set_payloads(spec, s)]
        keys = lmcache_keys(spec, s)
        return lambda: lmc.store(adapter, keys, objs)
    return prepare, adapter.close


def open_kvbucket(spec: dict[str, Any], *, sealed: bool) -> Any:
    from kvbucket.stores.guard.sealed import seal_store

    if spec["backend"] == "s3":
        from kvbucket.stores import open_store

        store = open_store(spec["url"] + ("/kv" if sealed else "/raw"), **spec["options"])
    else:
        from kvbucket.stores.hub.config import build_config
        from kvbucket.stores.hub.store import HFBucketStore

        store = HFBucketStore(build_config(
            bucket_handle=spec["handle"] + ("/kv" if sealed else "/raw"), token=TOKEN,
            endpoint=spec["endpoint"], token_env="", create_bucket_if_missing=True,
            load_timeout_secs=300.0, lookup_timeout_secs=60.0))
    return seal_store(store, tier="ceiling") if sealed else store


def _kvbucket_loader(spec: dict[str, Any]) -> Callable[[list[str], list[Any]], int]:
    store = open_kvbucket(spec, sealed=True)
    if spec["side"] == "hf_xet-stream":  # the same store, its reads through hf_xet's stream
        client = store.inner._client
        assert hasattr(client, "direct_reads"), "HFBucketStore's client moved"
        client.direct_reads = False

    def load(nms: list[str], bufs: list[Any]) -> int:
        missed = [r for r in store.head_many(nms) if r.size is None]
        assert not missed, missed[:2]
        return sum(r.ok for r in store.get_many(nms, bufs))
    return load


def _obstore_loader(spec: dict[str, Any]) -> Callable[[list[str], list[Any]], int]:
    from concurrent.futures import ThreadPoolExecutor

    import obstore
    from obstore.store import S3Store as ObS3Store

    o = spec["obstore"]
    st = ObS3Store(o["bucket"], prefix="raw", endpoint=o["endpoint"], region=o["region"],
                   access_key_id=o["key"], secret_access_key=o["secret"], client_options={"allow_http": True})
    pool = ThreadPoolExecutor(PEER_THREADS)

    def get(nm: str, buf: Any) -> bool:
        data = obstore.get(st, nm).bytes()
        memoryview(buf)[:] = memoryview(data)
        return True

    def load(nms: list[str], bufs: list[Any]) -> int:
        assert all(pool.map(lambda nm: obstore.head(st, nm)["size"] > 0, nms))
        return sum(pool.map(get, nms, bufs))
    return load


def _boto3_loader(spec: dict[str, Any]) -> Callable[[list[str], list[Any]], int]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    o = spec["obstore"]
    s3 = boto3.client("s3", endpoint_url=o["endpoint"], region_name=o["region"], aws_access_key_id=o["key"],
                      aws_secret_access_key=o["secret"],
                      config=Config(max_pool_connections=PEER_THREADS, s3={"addressing_style": "path"}))
    pool = ThreadPoolExecutor(PEER_THREADS)

    def get(nm: str, buf: Any) -> bool:
        body = s3.get_object(Bucket=o["bucket"], Key=f"raw/{nm}")["Body"]
        view, got = memoryview(buf), 0
        while got < len(view):
            data = body.read(len(view) - got)
            if not data:
                break
            view[got : got + len(data)] = data
            got += len(data)
        return got == len(view)

    def load(nms: list[str], bufs: list[Any]) -> int:
        assert all(pool.map(lambda nm: s3.head_object(Bucket=o["bucket"], Key=f"raw/{nm}"), nms))
        return sum(pool.map(get, nms, bufs))
    return load


def _download_loader(spec: dict[str, Any]) -> Callable[[list[str], list[Any]], int]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=spec["endpoint"], token=TOKEN)
    bucket_id = spec["bucket_id"]
    def load(nms: list[str], bufs: list[Any]) -> int:
        tmp = Path(tempfile.mkdtemp(prefix="bench-ceiling-", dir=_shm()))
        try:
            paths = [f"raw/{nm}" for nm in nms]
            assert len(list(api.get_bucket_paths_info(bucket_id, paths))) == len(nms)
            api.download_bucket_files(bucket_id,
                                      [(p, str(tmp / nm)) for p, nm in zip(paths, nms, strict=True)])
            for nm, b in zip(nms, bufs, strict=True):
                with open(tmp / nm, "rb") as f:
                    f.readinto(b)
            return len(nms)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load


def _lmcache_loader(spec: dict[str, Any]) -> Callable[[list[str], list[Any]], int]:
    """LMCache's adapter: lookup-and-lock, load into the buffers (tensor views of them), unlock."""
    import torch

    adapter = lmc.open_adapter(spec["lmcache"], spec.get("endpoint"))
    keys = {nm: k for s in range(2) for nm, k in zip(names(spec, s), lmcache_keys(spec, s), strict=True)}

    def load(nms: list[str], bufs: list[Any]) -> int:
        return lmc.lookup_load(adapter, [keys[nm] for nm in nms], [lmc.memory_obj(torch.from_numpy(b))
                                                                    for b in bufs])
    return load


LOADERS: dict[str, Callable[[dict[str, Any]], Callable[[list[str], list[Any]], int]]] = {
    "kvbucket-s3": _kvbucket_loader, "kvbucket-hub": _kvbucket_loader, "hf_xet-stream": _kvbucket_loader,
    "obstore": _obstore_loader, "boto3": _boto3_loader, "download_bucket_files": _download_loader,
    "lmcache-s3": _lmcache_loader, "lmcache-hfbucket": _lmcache_loader, SENDFILE: _kvbucket_loader}


def run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise RuntimeError(f"{spec['side']} {spec['mode']} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


# ---- servers -------------------------------------------------------------------------------
@contextlib.contextmanager
def s3_target() -> Iterator[dict[str, Any]]:
    weed = lmc.lmcache_seaweedfs()  # path-style clients at localhost, LMCache's adapter at 127.0.0.1
    server = weed.start()
    with contextlib.ExitStack() as stack:
        stack.callback(weed.stop)
        bucket = server.create_bucket("ceiling")
        server.create_bucket(lmc.LMCACHE_S3_BUCKET)
        creds = {"aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key}
        assert weed.proc is not None
        root = tempfile.mkdtemp(prefix="bench-ceiling-sendfile-", dir=_shm())
        cheap = subprocess.Popen([sys.executable, str(BENCH / "sendfile_s3.py"), root],
                                 stdout=subprocess.PIPE, text=True)
        assert cheap.stdout is not None
        port = int(cheap.stdout.readline().split()[1])
        stack.callback(shutil.rmtree, root, True)
        stack.callback(cheap.wait, 30)
        stack.callback(cheap.terminate)
        yield {"backend": "s3", "url": f"s3://{bucket}", "server_pid": weed.proc.pid,
               "sendfile": {"root": root, "endpoint": f"http://127.0.0.1:{port}", "pid": cheap.pid},
               "options": {"s3_endpoint_url": server.endpoint_url, "s3_region": server.region,
                           "disable_tls": True, **creds, "s3_unsigned_payload": True},
               "obstore": {"bucket": bucket, "endpoint": server.endpoint_url, "region": server.region,
                           "key": server.access_key, "secret": server.secret_key},
               "lmcache": lmc.s3_adapter_spec(server)}


@contextlib.contextmanager
def hub_target() -> Iterator[dict[str, Any]]:
    from kvbucket.testing.hub_emulator import HubEmulator

    tmp = tempfile.mkdtemp(prefix="bench-ceiling-lmcache-", dir=_shm())  # LMCache's downloads, as advised
    try:
        with HubEmulator(tokens={"me": (TOKEN, "write")}, subprocess=True) as emu:
            yield {"backend": "hub", "endpoint": emu.endpoint, "handle": "hf://buckets/me/ceiling",
                   "bucket_id": "me/ceiling", "server_pid": emu.pid,
                   "lmcache": {"type": "hfbucket", "bucket_handle": "hf://buckets/me/ceiling-lmcache",
                               "token": TOKEN, "create_bucket_if_missing": True, "download_tmp_dir": tmp}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TARGETS = {"s3": s3_target, "hub": hub_target}


def _shm() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def mirror(target: dict[str, Any], nms: list[str]) -> None:
    """Copy the sealed objects ``kvbucket-s3`` stored under these names from SeaweedFS to the
    sendfile server's root (untimed), so ``SENDFILE`` loads the same bytes."""
    import boto3
    from botocore.config import Config

    o = target["obstore"]
    s3 = boto3.client("s3", endpoint_url=o["endpoint"], region_name=o["region"], aws_access_key_id=o["key"],
                      aws_secret_access_key=o["secret"], config=Config(s3={"addressing_style": "path"}))
    where = Path(target["sendfile"]["root"]) / o["bucket"] / "kv"
    where.mkdir(parents=True, exist_ok=True)
    for nm in nms:
        s3.download_file(o["bucket"], f"kv/{nm}", str(where / nm))


def side_spec(base: dict[str, Any], side: str, mode: str) -> dict[str, Any]:
    """A child's spec: ``SENDFILE`` is kvbucket-s3 with the sendfile server as its endpoint and server."""
    if side != SENDFILE:
        return {**base, "side": side, "mode": mode}
    cheap = base["sendfile"]
    return {**base, "side": side, "mode": mode, "server_pid": cheap["pid"],
            "options": {**base["options"], "s3_endpoint_url": cheap["endpoint"]}}


# ---- main ----------------------------------------------------------------------------------
def write_sets(kind: str, size: int, n: int, tag: str, where: str) -> tuple[list[str], list[list[str]]]:
    """The two sets' payloads as files (children map them) and their digests."""
    import numpy as np

    from kvbucket.testing.payloads import payload

    files, digests = [], []
    for s in range(2):
        path = os.path.join(where, f"{kind}-{size}-{s}.bin")
        mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(n * size,))
        ds = []
        for i in range(n):
            piece = mm[i * size : (i + 1) * size]
            piece[:] = payload(kind, size, f"{tag}-{kind}-{size}-{s}-{i}")
            ds.append(digest(piece))
        mm.flush()
        del mm
        files.append(path)
        digests.append(ds)
    return files, digests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="s3,hub")
    p.add_argument("--sizes", default="2,8,32", help="object sizes, MiB")
    p.add_argument("--total-mib", type=int, default=512, help="MiB per set (each size: total / size objects)")
    p.add_argument("--payloads", default="kv,random", help="kv (realistic bf16 KV) and/or random")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per side and setting")
    p.add_argument("--sides", default="", help="only these sides (comma-separated); default all")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 MiB objects, 4 MiB per set, 1 round, "
                   "the payloads after the first on kvbucket's sides only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_argument(p)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.quick:
        args.sizes, args.total_mib, args.rounds = "2", 4, 1
    backends = [b for b in args.backends.split(",") if b]
    parts = list(backends) if set(backends) != {"s3", "hub"} else []
    parts += [] if args.payloads == "kv,random" else [args.payloads.replace(",", "+")]
    variant = "-".join(parts) or None  # a run of one backend or payload does not replace another's
    res = Results("bench_ceiling", variant=variant, params=vars(args),
                  title=f"Ceiling per process: CPU and GIL-held seconds per GiB ({', '.join(backends)})",
                  notes="GIL-held from py-spy record --gil" if pyspy() else
                  "py-spy not installed: no GIL figures")
    wanted = {s for s in args.sides.split(",") if s}
    tag = os.urandom(4).hex()
    home = tempfile.mkdtemp(prefix="bench-ceiling-", dir=_shm())
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    env.pop("HF_TOKEN", None)
    cells: dict[tuple[str, str, str, str, int, str], list[dict[str, Any]]] = {}
    print(f"load average at start: {os.getloadavg()}; GIL meter: {pyspy() or 'none'}", flush=True)
    try:
        for backend in backends:
            with TARGETS[backend]() as target:
                every = [s for s in SIDES[backend] if not wanted or s in wanted]
                for i, kind in enumerate([k for k in args.payloads.split(",") if k]):
                    sides = [s for s in every if not (args.quick and i) or s.startswith("kvbucket")]
                    for mib in [int(x) for x in args.sizes.split(",") if x]:
                        size, n = mib << 20, max(1, args.total_mib // mib)
                        files, expect = write_sets(kind, size, n, tag, home)
                        base = {**target, "kind": kind, "size": size, "n": n, "tag": tag, "files": files}
                        stores = ["raw"] if any(s not in STORING and s != SENDFILE for s in sides) else []
                        stores += [s for s in sides if s in STORING]
                        if SENDFILE in sides and "kvbucket-s3" not in stores:
                            stores.append("kvbucket-s3")  # what SENDFILE reads
                        for side in stores:  # the kvbucket sides' stores are measured (cold, warm)
                            fresh = dict(env, HF_HOME=tempfile.mkdtemp(dir=home))
                            out = run_child(side_spec(base, side, "store"), fresh)
                            for ph in out["phases"]:
                                record(res, cells, backend, side, kind, mib, ph, 1, True)
                        if SENDFILE in sides:
                            mirror(target, names(base, 0) + names(base, 1))
                        for r in range(args.rounds):
                            for side in sides if r % 2 == 0 else sides[::-1]:
                                fresh = dict(env, HF_HOME=tempfile.mkdtemp(dir=home))
                                out = run_child(side_spec(base, side, "load"), fresh)
                                for s, ph in enumerate(out["phases"]):
                                    ok = ph.pop("digests") == expect[s] and ph["loaded"] == n
                                    record(res, cells, backend, side, kind, mib, ph, r + 1, ok)
                        for f in files:
                            os.unlink(f)
                        if SENDFILE in sides:
                            shutil.rmtree(Path(target["sendfile"]["root"]) / target["obstore"]["bucket"])
    finally:
        shutil.rmtree(home, ignore_errors=True)
        summarize(res, cells)
        print(f"load average at end: {os.getloadavg()}")
        res.write(args.results_dir)
    return 0


def record(res: Results, cells: dict[Any, list[dict[str, Any]]], backend: str, side: str, kind: str, mib: int,
           ph: dict[str, Any], rnd: int, ok: bool) -> None:
    row = {"backend": backend, "side": side, "op": ph["op"], "payload": kind, "size_mib": mib,
           "phase": ph["phase"], "round": rnd, "gibs": ph["gibs"], "cores": ph["cores"],
           "cpu_s_per_gib": ph["cpu_s_per_gib"],
           "gil_s_per_gib": ph["gil_s_per_gib"], "ceiling_gibs": ph["ceiling_gibs"], "verified": ok,
           "wall_s": ph["wall_s"], "server_cores": ph.get("server_cores"), "box_cores": ph.get("box_cores"),
           "box_cpus": ph.get("box_cpus"), "busy_threads": ph.get("busy_threads"),
           "runq_wait_s": ph.get("runq_wait_s"), "threads": ph.get("threads", [])}
    res.run(**row)
    cells.setdefault((backend, side, ph["op"], kind, mib, ph["phase"]), []).append(row)
    gil = ph["gil_s_per_gib"]
    print(f"{backend:3} {side:22} {ph['op']:5} {kind:6} {mib:3} MiB {ph['phase']:4} r{rnd}: "
          f"{ph['gibs'] or 0:6.2f} GiB/s  CPU {ph['cpu_s_per_gib']:.3f} s/GiB  "
          f"GIL {'-' if gil is None else f'{gil:.3f}'} s/GiB  {'ok' if ok else 'WRONG BYTES'}", flush=True)
    print("    " + thread_line(row), flush=True)


def thread_line(row: dict[str, Any]) -> str:
    """Who did a phase's work: its threads' CPU shares, and the client's, server's and box's cores."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    threads = ", ".join(f"{t['name']} {t['cpu_s']:.2f} s ({t['share']:.0%})" for t in row["threads"][:6])
    return (f"threads: {threads or '-'} | cores: client {f(row['cores'])} + server {f(row['server_cores'])}"
            f" (box busy {f(row['box_cores'])} of {row['box_cpus'] or '?'}) | run-queue wait "
            f"{f(row['runq_wait_s'])} s over {row['wall_s']:.2f} s")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None and r["verified"]]
    return statistics.median(vals) if vals else None


def summarize(res: Results, cells: dict[Any, list[dict[str, Any]]]) -> None:
    """One figure per cell (GIL-held s/GiB, with CPU and the ceiling beside it), and the ceiling of
    kvbucket's load next to each peer's (warm, the largest size, each payload)."""
    for (backend, side, op, kind, mib, phase), rows in cells.items():
        gil = _median(rows, "gil_s_per_gib")
        res.figure(f"{backend} {side} {op} {kind} {mib} MiB {phase}", gil, "s/GiB",
                   label=f"{side} {op}, {kind}, {mib} MiB, {phase}: GIL-held", backend=backend, side=side,
                   op=op, payload=kind, size_mib=mib, phase=phase,
                   cpu_s_per_gib=_median(rows, "cpu_s_per_gib"),
                   gil_s_per_gib=gil, ceiling_gibs=(1 / gil) if gil else None, gibs=_median(rows, "gibs"),
                   cores=_median(rows, "cores"), server_cores=_median(rows, "server_cores"),
                   box_cores=_median(rows, "box_cores"), busy_threads=_median(rows, "busy_threads"),
                   rounds=len(rows), verified=all(r["verified"] for r in rows))
    for (backend, side, op, kind, mib, phase), rows in cells.items():
        ours = f"kvbucket-{backend}"
        if side == ours or op != "load" or phase != "warm":
            continue
        mine = cells.get((backend, ours, op, kind, mib, phase))
        if not mine or mib != max(k[4] for k in cells if k[0] == backend):
            continue
        a, b = _median(mine, "gil_s_per_gib"), _median(rows, "gil_s_per_gib")
        if a and b:
            res.compare(f"{backend} {kind} {mib} MiB ceiling vs {side}",
                        f"{backend} load ceiling (1 / GIL-held), {kind}, {mib} MiB, warm",
                        ours=1 / a, peer=1 / b, peer_name=side, ours_name=ours, unit="GiB/s")


if __name__ == "__main__":
    raise SystemExit(main())
