"""LMCache's built-in L2 adapters next to kvbucket's plugin adapter, on the same servers, as ratios.

Each adapter runs under the unmodified ``lmcache bench l2`` (a subprocess per adapter, so every
adapter gets a fresh process and identical methodology: same keys, sizes, rounds, in-flight
depth, round-trip verification). Pairs:

- ``hfbucket``: LMCache's ``{"type": "hfbucket"}`` vs kvbucket's plugin with ``{"type": "hfbucket"}``,
  both against the local Hub emulator (``kvbucket.testing.hub_emulator``, its own process);
- ``s3``: LMCache's ``{"type": "s3"}`` (awscrt) vs kvbucket's ``{"type": "s3"}``, both against
  SeaweedFS (``kvbucket.testing.s3_server``). LMCache's adapter only speaks virtual-hosted
  requests to the host in ``s3_endpoint``, so it is pointed at ``127.0.0.1:<port>`` with SeaweedFS
  serving domain ``0.0.1`` (Host ``127.0.0.1`` = bucket ``127``); kvbucket is given the same bare
  host (plus a prefix), so both send the same virtual-hosted requests to the same bucket;
- ``fs``: LMCache's ``{"type": "fs"}`` vs kvbucket's ``{"type": "fs"}`` on a local directory.

What is timed, per round (keys/s = keys per second of the median round):

- ``Store``: LMCache's ``bench_store``, as is.
- ``Lookup+Load``: what a hit really costs, with kvbucket's defaults (read-ahead on): a
  lookup-and-lock, then at once the load of the same keys, timed as one (load buffers zeroed
  before). With read-ahead a lookup hit starts the load, so the two are only honest together:
  timed apart, the lookup carries part of the load's work and the load finds bytes already read
  ahead (10-26x "load" ratios that measured nothing).
- ``Lookup`` and ``Load`` alone (LMCache's ``bench_lookup`` and ``bench_load``): against a second
  kvbucket adapter with read-ahead off (and, on a Hub bucket, ``prefetch_reconstructions`` off),
  its own location and stores, so a lookup does only a lookup and a load all of the load (and its
  reads come first: no reconstruction it cached for a lookup + load helps its load).

Prints ops/s per operation and the ratio kvbucket / LMCache. Goals (0 ms, realistic KV or random
payloads, Hub bucket only, see ``l2_report.GOALS``): issue 23, 64 x 2 MiB and 16 x 8 MiB: >= 1.5x on load,
which kvbucket reports as lookup + load with read-ahead on, and >= 1.0x on store; issue 30,
64 x 2 MiB: >= 1.5x on load with read-ahead off and >= 1.1x on store.

    PYTHONPATH=src python benchmarks/bench_l2.py --backends hfbucket,s3 --num-keys 64 \
        --data-size-kb 2048 --rounds 5
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import l2_link  # this script's directory
from l2_report import (
    OPS,
    RA_OFF,
    mean_runs,
    paired,
    ratio_table,
    record,
    variant,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")
PLUGIN = {"type": "plugin", "module_path": "kvbucket.integrations.lmcache", "class_name": "KVBucketL2Adapter"}
#: Operations timed on an adapter whose lookups start loads (read-ahead on): its lookup and load
#: apart would each measure part of the other.
READ_AHEAD_OPS = ("Store", "Lookup+Load")
BENCH_KEYRING_ENV = "KVBUCKET_BENCH_KEYRING"
INTEGRITY_RUNS: list[tuple[str, dict]] = []  # (backend, every adapter's ops/s), with --integrity
SERVER_RUNS: list[tuple[str, dict]] = []  # (backend, every adapter's results), with --server-stats
def _omp(args: argparse.Namespace) -> dict[str, str]:
    """LMCache's bench zeroes its load buffers with torch before each round; torch's OpenMP
    workers then spin-wait for a while, burning a core the server and both adapters need on a
    small machine (measured here on 2 cores: the harness doubled every adapter's client CPU).
    One OpenMP thread removes that for both sides alike; ``--omp-threads 0`` keeps torch's default."""
    return {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else {}


def run_bench(spec: dict[str, Any], env: dict[str, str], args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"result-{os.urandom(4).hex()}.json"
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "bench", "l2",
        "--l2-adapter", json.dumps(spec),
        "--num-keys", str(args.num_keys), "--data-size-kb", str(args.data_size_kb),
        "--rounds", str(args.rounds), "--warmup-rounds", "1", "--in-flight", str(args.in_flight),
        "--lookup-max-hit-rate", "1.0", "--no-skip-verify", "--format", "json", "--output", str(out),
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": SRC, "LMCACHE_DISABLE_BANNER": "1", **_omp(args), **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=workdir, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-2500:]
        raise RuntimeError(f"lmcache bench l2 failed for {spec.get('type')}: {tail}")
    verified = "data verified OK" in proc.stdout
    metrics = json.loads(out.read_text())["metrics"]
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    ops["verified"] = verified
    return ops


def run_interleaved(builtin: dict, plugin: dict, env: dict[str, str], args: argparse.Namespace,
                    workdir: Path, backend: str = "", probe: dict | None = None) -> tuple[dict, dict]:
    """Both adapters in one process (a subprocess, so HF_ENDPOINT etc. apply from the start),
    driven by LMCache's own bench runners one round at a time, alternating which goes first.
    Load drift on a shared machine then hits both sides alike. Ops/s from the median round."""
    job = workdir / f"job-{os.urandom(4).hex()}.json"
    specs = {"lmcache": builtin, "kvbucket": plugin, RA_OFF: read_ahead_off(_fresh_location(plugin, 92))}
    if args.integrity:  # the same adapter without the envelope, and with AES-256-GCM on
        specs["kvbucket-unsealed"] = _fresh_location(plugin, 90)
        aes = _fresh_location(plugin, 91)
        aes["adapter_params"]["encryption"] = {"keyring_env": BENCH_KEYRING_ENV}
        specs["kvbucket-aes"] = aes
        env = {**env, BENCH_KEYRING_ENV: json.dumps(
            {"tenants": {"*": {"1": base64.b64encode(os.urandom(32)).decode()}}})}
    ahead = {w: w != "lmcache" and spec["adapter_params"].get("read_ahead", True)
             for w, spec in specs.items()}
    job.write_text(json.dumps({"specs": specs, "read_ahead": ahead, "num_keys": args.num_keys,
                               "random": args.integrity or args.random_payloads,
                               "payload": args.payloads if args.integrity or args.random_payloads else None,
                               "data_size": args.data_size_kb * 1024, "rounds": args.rounds,
                               "probe": probe if args.server_stats else None}))
    full_env = {**os.environ, "PYTHONPATH": SRC, "LMCACHE_DISABLE_BANNER": "1", **_omp(args), **env}
    proc = subprocess.run([sys.executable, __file__, "--worker", str(job)], capture_output=True, text=True,
                          env=full_env, cwd=workdir, timeout=1800)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"interleaved run failed: {(proc.stdout + proc.stderr)[-2500:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    if args.integrity:
        INTEGRITY_RUNS.append((backend, out))
    if args.server_stats:
        SERVER_RUNS.append((backend, out))
    return out["lmcache"], {w: out[w] for w in ("kvbucket", RA_OFF)}


def read_ahead_off(spec: dict[str, Any]) -> dict[str, Any]:
    """kvbucket's plugin spec with nothing done at lookup time for the load to come: read-ahead
    off and, on a Hub bucket, no Xet reconstructions asked for with a lookup hit."""
    params = {**spec["adapter_params"], "read_ahead": False}
    if params.get("type") == "hfbucket":
        params["prefetch_reconstructions"] = False
    return {**spec, "adapter_params": params}


def _server_sample(probe: dict | None) -> dict[str, float]:
    """The server's CPU seconds (``cpu``) and request counters now, for per-round deltas.

    SeaweedFS: its Prometheus counters (requests by type; bytes received and sent). The Hub
    emulator: its stats route (requests per route; ``xorb_upload`` bytes in, ``fetch`` bytes out).
    """
    import re
    import urllib.request

    if not probe:
        return {}
    with open(f"/proc/{probe['pid']}/stat") as f:  # utime + stime of all the server's threads
        fields = f.read().rsplit(")", 1)[1].split()
    out: dict[str, float] = {"cpu": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")}
    req = urllib.request.Request(probe["url"])
    if probe["kind"] == "hub":
        req.add_header("X-Emulator-Admin", probe["admin"])
        with urllib.request.urlopen(req, timeout=30) as r:
            routes = json.loads(r.read())["routes"]
        for name, st in routes.items():
            if name != "control":
                out[name] = st["requests"]
        out["xorb_bytes_in"] = routes.get("xorb_upload", {}).get("bytes_in", 0)
        out["fetch_bytes_out"] = routes.get("fetch", {}).get("bytes_out", 0)
        return out
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    for m in re.finditer(r'^SeaweedFS_s3_request_total\{[^}]*type="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    for key, metric in (("bytes_in", "received"), ("bytes_out", "sent")):
        out[key] = sum(float(v) for v in re.findall(
            rf"^SeaweedFS_s3_bucket_traffic_{metric}_bytes_total\{{[^}}]*\}} (\S+)$", text, re.M))
    return out


def _worker(job_path: str) -> None:
    import gc
    import statistics
    import time

    import torch
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        create_l1_memory_desc,
        make_aligned_tensor,
        make_memory_objects,
        make_object_keys,
        verify_round_trip,
    )
    from lmcache.cli.commands.bench.l2_adapter_bench.runner import (
        _PLACEHOLDER_LAYOUT_DESC,
        _wait_load_finished,
        _wait_lookup_finished,
        bench_load,
        bench_lookup,
        bench_store,
    )
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from unsealed import unsealed_l2_adapters  # benchmarks/unsealed.py (this script's directory)

    job = json.loads(Path(job_path).read_text())
    n, size, rounds = job["num_keys"], job["data_size"], job["rounds"] + 1  # + 1 warmup
    names = list(job["specs"])
    kind = job.get("payload") or ("random" if job.get("random", False) else None)

    def fill(who: str, r: int) -> None:
        """New bytes for round ``r`` of adapter ``who`` (realistic bf16 KV by default, random bytes
        with ``--payloads random``), the same each time it is asked for.

        LMCache's bench fills every object with one repeated byte, the same for every adapter
        and round. A Hub bucket deduplicates content-defined chunks, so such payloads are read
        back from chunks stored by earlier rounds (or other adapters), and a sealed object
        (its header in the first chunk) spans more stored ranges than an unsealed one: that
        measured the dedup, not the envelope. Real KV is not deduplicated across prompts, and Xet
        compresses it (0.88 of raw), so a load decodes it: :mod:`kvbucket.testing.payloads`.
        """
        if kind is not None:
            from kvbucket.testing.payloads import payload

            for i, obj in enumerate(store_objs[who]):
                obj.raw_data.copy_(torch.from_numpy(payload(kind, size, f"{names.index(who)}-{r}-{i}")))

    def lookup_then_load(a: Any, keys: list, objs: list) -> float | None:
        """Seconds from a lookup-and-lock of ``keys`` to the end of their load into ``objs``
        (zeroed before, untimed; unlocked after), as an engine does on a hit; None unless every
        key was found and loaded. Built from the waits of LMCache's own bench runner."""
        for obj in objs:
            obj.raw_data.zero_()
        t0 = time.perf_counter()
        tid = a.submit_lookup_and_lock_task(keys, {0: _PLACEHOLDER_LAYOUT_DESC})
        try:
            found = _wait_lookup_finished(a, [tid], 60.0).get(tid)
            if found is None or found.popcount() != len(keys):
                return None
            tid = a.submit_load_task(keys, objs)
            loaded = _wait_load_finished(a, [tid], 120.0).get(tid)
            secs = time.perf_counter() - t0
        finally:
            a.submit_unlock(keys)
        return secs if loaded is not None and loaded.popcount() == len(keys) else None

    adapters, store_objs, load_objs = {}, {}, {}
    for who in names:
        cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(job["specs"][who])]))
        buf = make_aligned_tensor(2 * n * size)
        raw = unsealed_l2_adapters() if who.endswith("-unsealed") else contextlib.nullcontext()
        with raw:
            adapters[who] = create_l2_adapter(cfg.adapters[0], l1_memory_desc=create_l1_memory_desc(buf))
        store_objs[who] = make_memory_objects(buf, n, size, 0)
        load_objs[who] = make_memory_objects(buf, n, size, n * size, fill_offset=1)
    # The interpreter's first full collection after the imports (torch, LMCache: 0.2-0.3 s, the
    # GIL held) otherwise lands in whichever round crosses its threshold: kvbucket's first
    # measured store, in every run on this machine (its store took 1.1 s instead of 0.75 s).
    # Collected here, once, it belongs to neither adapter.
    gc.collect()
    ahead = job.get("read_ahead", {})
    durations: dict[str, dict[str, list[float]]] = {w: {op: [] for op in OPS} for w in names}
    cpu_secs: dict[str, dict[str, list[float]]] = {w: {op: [] for op in OPS} for w in names}
    server: dict[str, dict[str, list[dict[str, float]]]] = {w: {op: [] for op in OPS} for w in names}
    probe = job.get("probe")
    verified = {w: True for w in names}
    quiet = lambda _msg: None  # noqa: E731
    for op in OPS:  # Store for all; Lookup, Load: read-ahead off; Lookup+Load: on (and LMCache)
        if op == "Lookup+Load":
            sides = [w for w in names if ahead.get(w, False) or w == "lmcache"]
        else:
            sides = [w for w in names if op in READ_AHEAD_OPS or not ahead.get(w, False)]
        for r in range(rounds):
            for who in sides if r % 2 == 0 else sides[::-1]:
                a = adapters[who]
                keys = make_object_keys(n, key_offset=r * n)
                os.sync()  # earlier rounds' dirty pages are written back now, not during this one
                if op != "Lookup":
                    fill(who, r)  # untimed; random payloads unless --constant-payloads
                srv0 = _server_sample(probe)
                cpu0 = time.process_time()
                if op == "Lookup+Load":
                    secs = lookup_then_load(a, keys, load_objs[who])
                else:
                    if op == "Store":
                        res = bench_store(a, 1, n, size, 1, lambda _r, k=keys: [k],
                                          lambda _r, w=who: [store_objs[w]], quiet)  # fmt: skip
                    elif op == "Lookup":
                        res = bench_lookup(a, 1, n, 1, lambda _r, k=keys: [k], quiet)
                    else:
                        res = bench_load(a, 1, n, size, 1, lambda _r, k=keys: [k],
                                         lambda _r, w=who: [load_objs[w]], quiet)  # fmt: skip
                    ok = res.success_counts == [n] and res.round_durations
                    secs = res.round_durations[0] if ok else None
                cpu = time.process_time() - cpu0
                srv1 = _server_sample(probe)
                if op in ("Load", "Lookup+Load"):
                    verified[who] &= verify_round_trip(keys, store_objs[who], load_objs[who], quiet)
                if r > 0:  # the first round warms up
                    durations[who][op].append(float("inf") if secs is None else secs)
                    cpu_secs[who][op].append(float("inf") if secs is None else cpu)
                    if probe:
                        server[who][op].append({k: v - srv0.get(k, 0) for k, v in srv1.items()})
    out = {}
    for who in names:
        out[who] = {"verified": verified[who]}
        for op in OPS:
            if not durations[who][op]:
                continue
            med = statistics.median(durations[who][op])
            out[who][op] = {"ops_per_sec_avg": n / med if med > 0 else 0.0,
                            "round_secs": durations[who][op], "cpu_secs": cpu_secs[who][op],
                            "server": server[who][op]}
        adapters[who].close()
    print("RESULT " + json.dumps(out), flush=True)


# ---- servers -----------------------------------------------------------------------------------
@contextlib.contextmanager
def hub_servers(tmp: Path) -> Iterator[tuple[dict, dict, dict[str, str], dict]]:
    from kvbucket.testing.hub_emulator import HubEmulator

    token = "hf_bench_" + os.urandom(8).hex()
    with HubEmulator(tokens={"bench": (token, "write")}, subprocess=True) as emu:
        env = {"HF_ENDPOINT": emu.endpoint, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"}
        builtin = {"type": "hfbucket", "bucket_handle": "hf://buckets/bench/lmcache-builtin",
                   "create_bucket_if_missing": True, "download_tmp_dir": str(tmp / "dl-builtin")}
        ours = {"type": "hfbucket", "bucket_handle": "hf://buckets/bench/kvbucket",
                "create_bucket_if_missing": True, "download_tmp_dir": str(tmp / "dl-kvbucket")}
        probe = {"pid": emu.pid, "kind": "hub", "url": f"{emu.endpoint}/_emulator/stats",
                 "admin": emu.config.admin_key}
        yield builtin, ours, env, probe


@contextlib.contextmanager
def s3_servers(tmp: Path) -> Iterator[tuple[dict, dict, dict[str, str], dict]]:
    from kvbucket.testing.s3_server import free_port
    from lmcache_adapters import LMCACHE_S3_BUCKET, lmcache_seaweedfs, s3_adapter_spec

    metrics_port = free_port()
    weed = lmcache_seaweedfs(extra_args=(f"-metricsPort={metrics_port}",))
    server = weed.start()
    try:
        server.create_bucket(LMCACHE_S3_BUCKET)
        host = f"127.0.0.1:{server.port}"
        creds = {"aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key}
        builtin = s3_adapter_spec(server)
        # The same virtual-hosted requests to the same bare host as LMCache's adapter, the same
        # request concurrency as its default (64) and, like awscrt, UNSIGNED-PAYLOAD signatures
        # (kvbucket signs bodies over plain HTTP unless told otherwise).
        ours = {"type": "s3", "s3_endpoint": f"{host}/kvbucket", "s3_region": server.region,
                "disable_tls": True, **creds, "s3_num_io_threads": 64, "s3_unsigned_payload": True}
        assert weed.proc is not None
        probe = {"pid": weed.proc.pid, "kind": "weed", "url": f"http://127.0.0.1:{metrics_port}/metrics"}
        yield builtin, ours, {}, probe
    finally:
        weed.stop()


@contextlib.contextmanager
def fs_servers(tmp: Path) -> Iterator[tuple[dict, dict, dict[str, str], dict]]:
    yield ({"type": "fs", "base_path": str(tmp / "fs-builtin")},
           {"type": "fs", "base_path": str(tmp / "fs-kvbucket")}, {}, {})


SERVERS = {"hfbucket": hub_servers, "s3": s3_servers, "fs": fs_servers}


def _fresh_location(spec: dict[str, Any], n: int) -> dict[str, Any]:
    """The same adapter spec writing to a location of its own for run ``n`` (no warm cache)."""
    params = dict(spec.get("adapter_params", spec))
    if "bucket_handle" in params:
        params["bucket_handle"] += f"-{n}"
    elif "base_path" in params:
        params["base_path"] += f"-{n}"
    elif "adapter_params" in spec and params.get("type") == "s3":  # kvbucket's s3: a prefix of its own
        params["s3_endpoint"] = params["s3_endpoint"].rstrip("/") + f"-{n}"
    if "adapter_params" in spec:
        return {**spec, "adapter_params": params}
    return params


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="hfbucket,s3", help="hfbucket, s3, fs")
    p.add_argument("--num-keys", type=int, default=64)
    p.add_argument("--data-size-kb", type=int, default=2048, help="2048: a 2 MiB chunk; 8192, 32768 too")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--in-flight", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=None, help="kvbucket num_workers (default: its own)")
    p.add_argument("--mode", choices=["interleaved", "cli"], default="interleaved",
                   help="interleaved: both adapters in one process, rounds alternating (default); "
                        "cli: the lmcache bench l2 command per adapter, ABBA order, averaged")
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for the bench process (0: torch's default; see _omp)")
    p.add_argument("--integrity", action="store_true",
                   help="also run kvbucket's adapter without the envelope and with AES-256-GCM "
                        "(interleaved mode), and print the ratios; every adapter then stores random "
                        "bytes, new each round (see _worker's fill)")
    p.add_argument("--payloads", choices=("kv", "random"), default="kv",
                   help="kv: realistic bf16 KV, new each round (the default); random: random bytes "
                        "(the second row: bench_l2-...-random.json)")
    p.add_argument("--random-payloads", action="store_true",
                   help="non-constant payloads: the default now (kept so older command lines still run)")
    p.add_argument("--constant-payloads", action="store_true",
                   help="the dedup case: LMCache's own one-byte-repeated chunks, which a Hub bucket "
                        "deduplicates to almost nothing (the default is random bytes, new each round, "
                        "as real KV is; the cli mode always uses LMCache's fill)")
    p.add_argument("--object-format", choices=["kvbucket", "lmcache"], default="kvbucket",
                   help="kvbucket's object_format: lmcache writes LMCache's names and raw bytes")
    p.add_argument("--server-stats", action="store_true",
                   help="also print, per adapter and operation, the mean client CPU, server CPU and "
                        "server requests (and bytes) per round, read from the server (interleaved mode)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    from results import Results, add_argument  # benchmarks/results.py (this script's directory)

    l2_link.add_arguments(p)
    add_argument(p)
    args = p.parse_args()
    args.random_payloads = not args.constant_payloads and args.mode == "interleaved"
    if args.worker:
        _worker(args.worker)
        return 0
    params = {k: v for k, v in vars(args).items() if k != "worker"}
    res = Results("bench_l2", variant=variant(args), params=params,
                  title="L2 adapters in LMCache's own bench runner: kvbucket's plugin vs LMCache's built-in",
                  notes="payloads: " + ({"kv": "realistic bf16 KV"}.get(args.payloads, args.payloads)
                                        if args.integrity or args.random_payloads else "constant"))
    pairs: list[tuple[str, dict, dict[str, dict]]] = []

    tmp = Path(tempfile.mkdtemp(prefix="kvbucket-bench-l2-"))
    failures = 0
    try:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            try:
                with SERVERS[backend](tmp) as found, l2_link.through_link(found, backend, args) as (
                        builtin, ours, env, probe):
                    if args.num_workers:
                        ours["num_workers"] = args.num_workers
                    if args.object_format != "kvbucket":
                        ours["object_format"] = args.object_format
                    plugin = {**PLUGIN, "adapter_params": ours}
                    if args.mode == "interleaved":
                        base, mine = run_interleaved(builtin, plugin, env, args, tmp, backend, probe)
                    else:
                        # ABBA order on the same server, averaged: a server that slows down (or
                        # warms up) as it fills penalises both sides equally. LMCache's runner
                        # times lookup and load apart: kvbucket's read-ahead is off here.
                        runs: dict[str, list[dict]] = {"lmcache": [], RA_OFF: []}
                        for n, who in enumerate(["lmcache", RA_OFF, RA_OFF, "lmcache"]):
                            spec = builtin if who == "lmcache" else read_ahead_off(plugin)
                            runs[who].append(run_bench(_fresh_location(spec, n), env, args, tmp))
                        base, off = mean_runs(runs["lmcache"]), mean_runs(runs[RA_OFF])
                        mine = {"kvbucket": {"verified": off["verified"], "Store": off["Store"]}, RA_OFF: off}
            except Exception as e:  # report and go on with the other backends
                print(f"[{backend}] could not run: {e}", file=sys.stderr)
                failures += 1
                continue
            pairs.append((backend, base, mine))
            if not (base["verified"] and all(m["verified"] for m in mine.values())):
                print(f"[{backend}] round-trip verification: lmcache={base['verified']} "
                      + " ".join(f"{w}={m['verified']}" for w, m in mine.items()), file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    how = "rounds interleaved in one process" if args.mode == "interleaved" else "lmcache bench l2, ABBA"
    how += f" ({l2_link.describe(args)})" if args.link_mbps else ""
    print(f"\n{how}: {args.num_keys} keys x {args.data_size_kb} KiB per submit, "
          f"kvbucket object_format={args.object_format}, "
          f"{args.in_flight} in flight, {args.rounds} rounds (ops/s = keys per second)"
          + (f", {args.payloads} payloads" if args.integrity or args.random_payloads
             else ", CONSTANT payloads (one repeated byte per chunk: the dedup case)"))
    print("\n".join(ratio_table(pairs, args)))
    if INTEGRITY_RUNS:
        print("\nkvbucket: sealed (verified) vs unsealed, and AES-256-GCM vs sealed. Ratios of the median "
              "rounds' ops/s,\nthen [paired]: the median (and quartiles) of per-round ratios, each round's "
              "adapters run back to back")
        print(f"{'backend':<9} {'op':<11} {'unsealed':>10} {'sealed':>10} {'aes':>10} "
              f"{'sealed/unsealed':>16} {'aes/sealed':>11}  {'[paired] sealed/unsealed':>25} "
              f"{'aes/sealed':>19}")
        cpu_rows: list[str] = []
        for backend, out in INTEGRITY_RUNS:
            for op in READ_AHEAD_OPS:  # all three have read-ahead on
                trio = ("kvbucket-unsealed", "kvbucket", "kvbucket-aes")
                raw, sealed, aes = (out[w][op]["ops_per_sec_avg"] for w in trio)
                secs = {w: out[w][op]["round_secs"] for w in trio}
                p_sealed = paired(secs["kvbucket-unsealed"], secs["kvbucket"])
                p_aes = paired(secs["kvbucket"], secs["kvbucket-aes"])
                print(f"{backend:<9} {op:<11} {raw:>10.1f} {sealed:>10.1f} {aes:>10.1f} "
                      f"{sealed / raw if raw else 0:>16.3f} {aes / sealed if sealed else 0:>11.3f}  "
                      f"{p_sealed:>25} {p_aes:>19}")
                c_raw, c_sealed, c_aes = (out[w][op]["cpu_secs"] for w in trio)
                cpu_rows.append(f"{backend:<9} {op:<11} {paired(c_raw, c_sealed):>25} "
                                f"{paired(c_sealed, c_aes):>19}")
        print("\nThe same as client CPU (this process's CPU time per round, servers excluded): "
              "unsealed CPU / sealed CPU,\nsealed CPU / aes CPU, paired by round. On a machine whose "
              "cores are all busy, CPU is throughput.")
        print(f"{'backend':<9} {'op':<11} {'sealed/unsealed':>25} {'aes/sealed':>19}")
        print("\n".join(cpu_rows))
    if SERVER_RUNS:
        _print_server_stats(args.num_keys)
    record(res, args, pairs)
    res.write(args.results_dir)
    return 1 if failures else 0


def _print_server_stats(num_keys: int) -> None:
    """Medians over rounds: client CPU, server CPU (ms per round) and server counters per key."""
    import statistics

    print(f"\nPer round (means; counters per key, {num_keys} keys a round): client CPU = the bench "
          "process's CPU time,\nserver CPU = the server process's (all threads, from /proc, 10 ms ticks)")
    print(f"{'backend':<9} {'op':<11} {'adapter':<18} {'client ms':>9} {'server ms':>9}  counters per key")
    for backend, out in SERVER_RUNS:
        for op in OPS:
            for who, res in out.items():
                rounds = res.get(op, {}).get("server") or []
                if not rounds:
                    continue
                cpu = [c for c in res[op]["cpu_secs"] if c < float("inf")]
                client = 1000 * statistics.fmean(cpu) if cpu else float("nan")
                srv = 1000 * statistics.fmean(r.get("cpu", 0.0) for r in rounds)
                keys = sorted({k for r in rounds for k in r if k != "cpu"})
                per = {k: statistics.fmean(r.get(k, 0.0) for r in rounds) / num_keys for k in keys}
                text = ", ".join(f"{k} {v:.3g}" for k, v in per.items() if v)
                print(f"{backend:<9} {op:<11} {who:<18} {client:>9.1f} {srv:>9.1f}  {text}")


if __name__ == "__main__":
    raise SystemExit(main())
