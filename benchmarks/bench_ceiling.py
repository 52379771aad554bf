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
  hf_xet's and libcurl's included), per GiB moved;
- GIL-held s/GiB: ``py-spy record --gil --nonblocking`` attached to that process for the phase
  only: the samples whose thread held the GIL, over the sampling rate. Why py-spy and not a
  spin-probe thread: py-spy reads which thread holds the GIL from the interpreter's memory, from
  outside, so it neither takes the GIL nor competes for it, and it is not fooled by a thread that
  waits for a core rather than for the GIL (this machine's two cores are shared with the servers:
  a probe's wake-up latency would count run-queue waits as GIL). Without py-spy (``pip install
  py-spy``; it needs ptrace rights) the GIL figures are left empty;
- projected ceiling = 1 / GIL-held, GiB/s per process (not GIL-bound: empty when no GIL was seen);
- cores: client CPU seconds over wall seconds (> 1: the load kept more than one core busy).

Sides. S3: ``kvbucket-s3`` (a sealed ``S3Store``: ``head_many`` + ``get_many``, verified envelopes),
``obstore`` (``head`` + ``get`` in 16 threads, bytes copied into the buffers), ``boto3``
(``head_object`` + ``get_object`` ``readinto`` in 16 threads). Hub: ``kvbucket-hub`` (a sealed
``HFBucketStore``), ``hf_xet-stream`` (the same store reading through hf_xet's
``download_unordered_stream``, its bytes copied into the buffers) and ``download_bucket_files``
(huggingface_hub: paths-info, then hf_xet writes files to /dev/shm, read back into the buffers).
Peers read raw objects (no envelope) stored by kvbucket's unsealed store; kvbucket's sides also
report their **stores** (``put_many`` of each set: cold and warm) the same way.

Payloads: ``kv`` (realistic bf16 KV, :mod:`kvbucket.testing.payloads`) by default, ``random`` as
the second row. Rounds alternate the order of the sides; the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
SRC = str(BENCH.parent / "src")
sys.path.insert(0, str(BENCH))
sys.path.insert(0, SRC)
from results import Results, add_argument  # noqa: E402

TOKEN = "hf_bench_ceiling_" + "0" * 16
GIB = float(1 << 30)
SIDES = {"s3": ("kvbucket-s3", "obstore", "boto3"),
         "hub": ("kvbucket-hub", "hf_xet-stream", "download_bucket_files")}
#: Sides that store (and are timed storing); the others read what ``raw`` stored.
STORING = {"kvbucket-s3", "kvbucket-hub"}
PEER_THREADS = 16
PYSPY_RATE = 250


# ---- measuring ------------------------------------------------------------------------------
def pyspy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class GilMeter:
    """GIL-held seconds of this process while the block runs, from ``py-spy record --gil``."""

    def __init__(self, rate: int = PYSPY_RATE) -> None:
        self.rate = rate
        self.seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out = ""

    def __enter__(self) -> GilMeter:
        exe = pyspy()
        if exe is None:
            return self
        fd, self._out = tempfile.mkstemp(prefix="ceiling-gil-", suffix=".txt")
        os.close(fd)
        self._proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--gil", "--nonblocking", "--rate", str(self.rate),
             "--format", "raw", "-o", self._out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.6)  # attached and sampling (idle threads hold no GIL: nothing is counted)
        if self._proc.poll() is not None:
            self._proc = None
        return self

    def __exit__(self, *exc: Any) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return
        samples = 0
        with open(self._out, encoding="utf-8", errors="replace") as f:
            for line in f:
                head, _, n = line.rstrip().rpartition(" ")
                if head and n.isdigit():
                    samples += int(n)
        os.unlink(self._out)
        self.seconds = samples / self.rate


def measure(fn: Callable[[], Any], nbytes: int) -> dict[str, Any]:
    """Wall, client CPU and GIL-held seconds of ``fn()``, per GiB of ``nbytes``."""
    with GilMeter() as gil:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    gib = nbytes / GIB
    held = None if gil.seconds is None else gil.seconds / gib
    return {"result": out, "wall_s": wall, "gibs": gib / wall if wall > 0 else None,
            "cores": cpu / wall if wall > 0 else None, "cpu_s_per_gib": cpu / gib, "gil_s_per_gib": held,
            "ceiling_gibs": (1 / held) if held else None}


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
    side = spec["side"]
    if spec["mode"] == "store":
        store = open_kvbucket(spec, sealed=side != "raw")
        phases = []
        for s, phase in enumerate(("cold", "warm")):
            items = list(zip(names(spec, s), set_payloads(spec, s), strict=True))
            m = measure(lambda items=items: store.put_many(items), spec["n"] * spec["size"])
            bad = [str(r.error) for r in m.pop("result") if not r.ok]
            assert not bad, bad[:2]
            phases.append({"op": "store", "phase": phase, **m})
        store.close()
        return {"phases": phases if side != "raw" else []}
    import numpy as np

    load = LOADERS[side](spec)
    phases = []
    for s, phase in enumerate(("cold", "warm")):
        bufs = [np.empty(spec["size"], np.uint8) for _ in range(spec["n"])]
        for b in bufs:  # an engine's buffers are allocated and touched once (no page faults in a load)
            b.fill(0)
        m = measure(lambda s=s, bufs=bufs: load(names(spec, s), bufs), spec["n"] * spec["size"])
        loaded = m.pop("result")
        phases.append({"op": "load", "phase": phase, "loaded": loaded, "digests": [digest(b) for b in bufs],
                       **m})
    return {"phases": phases}


def open_kvbucket(spec: dict[str, Any], *, sealed: bool) -> Any:
    from kvbucket.stores.sealed import seal_store

    if spec["backend"] == "s3":
        from kvbucket.stores import open_store

        store = open_store(spec["url"] + ("/kv" if sealed else "/raw"), **spec["options"])
    else:
        from kvbucket.stores.hfbucket import HFBucketStore
        from kvbucket.stores.hfbucket_config import build_config

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
        assert all(r.size is not None for r in store.head_many(nms))
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
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None

    def load(nms: list[str], bufs: list[Any]) -> int:
        tmp = Path(tempfile.mkdtemp(prefix="bench-ceiling-", dir=shm))
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


LOADERS: dict[str, Callable[[dict[str, Any]], Callable[[list[str], list[Any]], int]]] = {
    "kvbucket-s3": _kvbucket_loader, "kvbucket-hub": _kvbucket_loader, "hf_xet-stream": _kvbucket_loader,
    "obstore": _obstore_loader, "boto3": _boto3_loader, "download_bucket_files": _download_loader}


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
    from kvbucket.testing.s3_server import SeaweedFS

    weed = SeaweedFS()
    server = weed.start()
    try:
        bucket = server.create_bucket("ceiling")
        host = f"127.0.0.1:{server.port}"
        creds = {"aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key}
        yield {"backend": "s3", "url": f"s3://{host}/{bucket}",
               "options": {"s3_region": server.region, "disable_tls": True, **creds,
                           "s3_unsigned_payload": True},
               "obstore": {"bucket": bucket, "endpoint": server.endpoint_url, "region": server.region,
                           "key": server.access_key, "secret": server.secret_key}}
    finally:
        weed.stop()


@contextlib.contextmanager
def hub_target() -> Iterator[dict[str, Any]]:
    from kvbucket.testing.hub_emulator import HubEmulator

    with HubEmulator(tokens={"me": (TOKEN, "write")}, subprocess=True) as emu:
        yield {"backend": "hub", "endpoint": emu.endpoint, "handle": "hf://buckets/me/ceiling",
               "bucket_id": "me/ceiling"}


TARGETS = {"s3": s3_target, "hub": hub_target}


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
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 MiB objects, 4 MiB per set, 1 round")
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
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    home = tempfile.mkdtemp(prefix="bench-ceiling-", dir=shm)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    env.pop("HF_TOKEN", None)
    cells: dict[tuple[str, str, str, str, int, str], list[dict[str, Any]]] = {}
    print(f"load average at start: {os.getloadavg()}; GIL meter: {pyspy() or 'none'}", flush=True)
    try:
        for backend in backends:
            with TARGETS[backend]() as target:
                sides = [s for s in SIDES[backend] if not wanted or s in wanted]
                for kind in [k for k in args.payloads.split(",") if k]:
                    for mib in [int(x) for x in args.sizes.split(",") if x]:
                        size, n = mib << 20, max(1, args.total_mib // mib)
                        files, expect = write_sets(kind, size, n, tag, home)
                        base = {**target, "kind": kind, "size": size, "n": n, "tag": tag, "files": files}
                        stores = ["raw"] if any(s not in STORING for s in sides) else []
                        stores += [s for s in sides if s in STORING]
                        for side in stores:  # the kvbucket sides' stores are measured (cold, warm)
                            fresh = dict(env, HF_HOME=tempfile.mkdtemp(dir=home))
                            out = run_child({**base, "side": side, "mode": "store"}, fresh)
                            for ph in out["phases"]:
                                record(res, cells, backend, side, kind, mib, ph, 1, True)
                        for r in range(args.rounds):
                            for side in sides if r % 2 == 0 else sides[::-1]:
                                fresh = dict(env, HF_HOME=tempfile.mkdtemp(dir=home))
                                out = run_child({**base, "side": side, "mode": "load"}, fresh)
                                for s, ph in enumerate(out["phases"]):
                                    ok = ph.pop("digests") == expect[s] and ph["loaded"] == n
                                    record(res, cells, backend, side, kind, mib, ph, r + 1, ok)
                        for f in files:
                            os.unlink(f)
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
           "gil_s_per_gib": ph["gil_s_per_gib"], "ceiling_gibs": ph["ceiling_gibs"], "verified": ok}
    res.run(**row)
    cells.setdefault((backend, side, ph["op"], kind, mib, ph["phase"]), []).append(row)
    gil = ph["gil_s_per_gib"]
    print(f"{backend:3} {side:22} {ph['op']:5} {kind:6} {mib:3} MiB {ph['phase']:4} r{rnd}: "
          f"{ph['gibs'] or 0:6.2f} GiB/s  CPU {ph['cpu_s_per_gib']:.3f} s/GiB  "
          f"GIL {'-' if gil is None else f'{gil:.3f}'} s/GiB  {'ok' if ok else 'WRONG BYTES'}", flush=True)


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
