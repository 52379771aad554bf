"""Is the Hub emulator ever the bottleneck? Measured against a raw loopback HTTP baseline, same run.

Prints, for 64 x 2 MiB objects pushed and pulled through the unmodified huggingface_hub/hf_xet
client: throughput through the emulator, throughput of a bare aiohttp loopback server moving the
same bytes, their ratio, and the emulator's own CPU seconds per GiB next to the client's (goal:
under a third). Also `get_bucket_paths_info` latency for 1 and 1,000 paths.

    PYTHONPATH=src python benchmarks/bench_emulator.py [--objects 64] [--mib 2]

The emulator runs in a subprocess so its CPU time (from its stats route) is its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_RAW_SERVER = r"""
import sys
from aiohttp import web
blobs = {}
async def put(request):
    blobs[request.match_info["k"]] = await request.read()
    return web.Response(text="ok")
async def get(request):
    return web.Response(body=blobs[request.match_info["k"]])
app = web.Application(client_max_size=1 << 30)
app.router.add_post("/{k}", put)
app.router.add_get("/{k}", get)
async def main():
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print("READY", site._server.sockets[0].getsockname()[1], flush=True)
    import asyncio
    await asyncio.Event().wait()
import asyncio
asyncio.run(main())
"""


def _cpu_of(pid: int) -> float:
    """User+system CPU seconds of a process, from /proc (the raw baseline server has no stats route)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_loopback(blobs: list[bytes], workers: int) -> dict[str, float]:
    import httpx2 as httpx  # the HTTP client huggingface_hub itself uses

    proc = subprocess.Popen([sys.executable, "-c", _RAW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        base = f"http://127.0.0.1:{port}"
        total = sum(map(len, blobs))
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(workers) as pool:
            s0 = _cpu_of(proc.pid)
            t0 = time.perf_counter()
            list(pool.map(lambda kv: client.post(f"{base}/{kv[0]}", content=kv[1]), enumerate(blobs)))
            up = time.perf_counter() - t0
            s1 = _cpu_of(proc.pid)
            t0 = time.perf_counter()
            got = list(pool.map(lambda i: client.get(f"{base}/{i}").content, range(len(blobs))))
            down = time.perf_counter() - t0
            s2 = _cpu_of(proc.pid)
        assert got == blobs
        return {"up": total / up, "down": total / down, "srv_up": s1 - s0, "srv_down": s2 - s1}
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--mib", type=float, default=2.0)
    ap.add_argument("--paths", type=int, default=1000)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results import Results, add_argument

    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_emulator", params=vars(args),
                  title="The Hub emulator's CPU against the client's (huggingface_hub + hf_xet)")

    work = Path(tempfile.mkdtemp(prefix="kvbucket-bench-"))
    os.environ["HF_HOME"] = str(work / "hf")
    os.environ["HF_XET_CACHE"] = str(work / "hf" / "xet")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    from huggingface_hub import HfApi

    from kvbucket.testing import HubEmulator

    size = int(args.mib * 1024 * 1024)
    blobs = [os.urandom(size) for _ in range(args.objects)]
    total = size * args.objects
    gib = total / 2**30
    mib = 2**20
    try:
        with HubEmulator(work / "data", {"bench": ("bench-token", "write")}, subprocess=True) as emu:
            api = HfApi(endpoint=emu.endpoint, token="bench-token")
            bid = "bench/b"
            api.create_bucket(bid, private=True)

            s0, c0, t0 = emu.stats()["process_cpu_s"], time.process_time(), time.perf_counter()
            api.batch_bucket_files(bid, add=[(b, f"kv/{i:04d}") for i, b in enumerate(blobs)])
            up_s = time.perf_counter() - t0
            s1, c1 = emu.stats()["process_cpu_s"], time.process_time()

            out = work / "down"
            t0 = time.perf_counter()
            api.download_bucket_files(bid, [(f"kv/{i:04d}", out / f"{i:04d}") for i in range(args.objects)])
            down_s = time.perf_counter() - t0
            s2, c2 = emu.stats()["process_cpu_s"], time.process_time()
            assert all((out / f"{i:04d}").read_bytes() == b for i, b in enumerate(blobs))

            (seed,) = api.get_bucket_paths_info(bid, ["kv/0000"])
            names = [f"pi/{i:05d}" for i in range(args.paths)]
            api.batch_bucket_files(bid, copy=[("bucket", bid, seed.xet_hash, n) for n in names])
            one = []
            for _ in range(50):
                t0 = time.perf_counter()
                assert len(list(api.get_bucket_paths_info(bid, names[:1]))) == 1
                one.append(time.perf_counter() - t0)
            many = []
            for _ in range(10):
                t0 = time.perf_counter()
                assert len(list(api.get_bucket_paths_info(bid, names))) == args.paths
                many.append(time.perf_counter() - t0)

        raw = raw_loopback(blobs, workers=8)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    emu_up, emu_down = total / up_s, total / down_s
    srv_up, srv_down = (s1 - s0) / gib, (s2 - s1) / gib
    cli_up, cli_down = (c1 - c0) / gib, (c2 - c1) / gib
    raw_up, raw_down = raw["srv_up"] / gib, raw["srv_down"] / gib
    print(
        f"{args.objects} x {args.mib:g} MiB objects ({total / mib:.0f} MiB) through huggingface_hub + hf_xet"
    )
    print(f"{'':34}{'upload':>10}{'download':>10}")
    print(f"{'emulator MiB/s':34}{emu_up / mib:10.1f}{emu_down / mib:10.1f}")
    print(f"{'raw loopback aiohttp MiB/s':34}{raw['up'] / mib:10.1f}{raw['down'] / mib:10.1f}")
    print(f"{'ratio emulator / raw':34}{emu_up / raw['up']:10.2f}{emu_down / raw['down']:10.2f}")
    print(f"{'emulator CPU s/GiB':34}{srv_up:10.2f}{srv_down:10.2f}")
    print(f"{'client CPU s/GiB':34}{cli_up:10.2f}{cli_down:10.2f}")
    print(f"{'raw loopback server CPU s/GiB':34}{raw_up:10.2f}{raw_down:10.2f}")
    print(f"{'ratio emulator CPU / client CPU':34}{srv_up / cli_up:10.2f}{srv_down / cli_down:10.2f}")
    print(
        f"paths-info latency: 1 path median {statistics.median(one) * 1e3:.2f} ms; "
        f"{args.paths} paths median {statistics.median(many) * 1e3:.1f} ms"
    )
    worst = max(srv_up / cli_up, srv_down / cli_down)
    verdict = "met" if worst < 1 / 3 else "NOT met"
    print(f"goal: emulator CPU under 1/3 of the client's; worst ratio {worst:.2f}: {verdict}")
    for op, srv, cli in (("upload", srv_up, cli_up), ("download", srv_down, cli_down)):
        res.compare(f"{op} cpu", f"{op}: CPU seconds per GiB ({args.objects} x {args.mib:g} MiB)", ours=srv,
                    ours_name="emulator", peer=cli, peer_name="client (huggingface_hub + hf_xet)",
                    unit="s/GiB", higher_is_better=False, goal=">= 3 (emulator under 1/3 of the client)")
    for op, emu, rawr in (("upload", emu_up, raw["up"]), ("download", emu_down, raw["down"])):
        res.compare(f"{op} throughput", f"{op} throughput", ours=emu / mib, ours_name="emulator",
                    peer=rawr / mib, peer_name="raw loopback aiohttp", unit="MiB/s")
    res.figure("paths_info_1", statistics.median(one) * 1e3, "ms", label="paths-info, 1 path (median)")
    res.figure("paths_info_n", statistics.median(many) * 1e3, "ms",
               label=f"paths-info, {args.paths} paths (median)")
    res.write(args.results_dir)


if __name__ == "__main__":
    main()
