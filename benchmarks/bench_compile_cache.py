"""Compile cache: batched sync/fetch against a naive one-request-per-file baseline, same run.

    PYTHONPATH=src python benchmarks/bench_compile_cache.py [--stores file,s3,hf] [--entries 500]
        [--files 5] [--neff-kib 32] [--torch] [--repeat 1] [--hub-latency-ms 0]

A local Neuron-layout cache of ``entries`` MODULE dirs with ``files`` files each is built once.
For every store:

- kvbucket ``sync`` into an empty area (flat area + packs), then ``fetch`` into an empty cache dir
  (from packs), then ``fetch/files``: the same fetch with ``packs=False`` (batched per-file reads)
  (all timed, store calls counted with :class:`CountingStore`, and on the Hub emulator the HTTP
  requests it served);
- the naive baseline into another empty area: one ``put`` per file, then a listing and one
  ``get`` per file (what a per-file client such as ``hf_hub_download``/``boto3.put_object`` in a
  loop does; it skips even the existence checks kvbucket makes, which favours the baseline).

It prints seconds, store calls and HTTP requests for both, and the ratios baseline/kvbucket
(goal: >= 10x fewer requests, >= 5x faster). Stores: ``file`` (FileStore), ``s3`` (a SeaweedFS
started here on free ports and stopped at the end), ``hf`` (the project's Hub emulator driven
by the unmodified huggingface_hub/hf_xet, when it is installed). ``--torch`` adds torch.compile
cold vs warm compile time (two fresh processes; the warm one fetches the cold one's artifacts).
``--hub-latency-ms N`` makes the Hub emulator add N ms to every Hub and CAS request it serves
(its own ``"*"`` latency fault rule, set for the whole hf run, so kvbucket and the baseline pay
it alike, and removed afterwards): on loopback a request costs about 1 ms, which hides what
round trips cost against a remote Hub.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbucket.compile_cache import NeuronLayout, fetch, sync
from kvbucket.stores.base import ObjectStore
from kvbucket.testing.counting_store import CountingStore

VERSION = "2.15.128.0+56dc5a86"
GROUP = f"neuronxcc-{VERSION}"


def build_cache(root: Path, entries: int, files: int, neff_bytes: int) -> int:
    """A Neuron-layout cache: ``model.neff`` + ``model.done`` + small files up to ``files``."""
    total = 0
    rnd = os.urandom(neff_bytes + 4096)
    for i in range(entries):
        d = root / GROUP / f"MODULE_{i:020d}+{i % 0xFFFFFFFF:08x}"
        d.mkdir(parents=True)
        blobs = {"model.neff": rnd[i % 4096 : i % 4096 + neff_bytes], "model.done": b"",
                 "model.hlo_module.pb": rnd[:512] + str(i).encode(), "compile_flags.json": b'["--O2"]'}
        for j in range(max(0, files - len(blobs))):
            blobs[f"extra_{j}.json"] = json.dumps({"entry": i, "j": j}).encode()
        for name, data in list(blobs.items())[:files]:
            (d / name).write_bytes(data)
            total += len(data)
    return total


@dataclass
class Row:
    store: str
    case: str
    seconds: float
    calls: int
    routes: dict[str, int] | None
    objects: int = 0  # objects read/written + listing pages: S3's HTTP requests (one per object)

    @property
    def http(self) -> int | None:
        return None if self.routes is None else sum(self.routes.values())


def naive_sync(store: ObjectStore, root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.startswith(".kvbucket"):
            store.put_many([(p.relative_to(root).as_posix(), p.read_bytes())])


def naive_fetch(store: ObjectStore, root: Path) -> None:
    for o in list(store.list(GROUP + "/")):
        (r,) = store.get_many([o.name])
        dest = root / o.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(bytes(r.data or b""))


@contextlib.contextmanager
def open_stores(kind: str, tmp: Path, hub_latency_ms: float = 0.0) -> Iterator[
        tuple[Callable[[str], ObjectStore], Callable[[], dict[str, int]] | None]]:
    """Yield (open a fresh area by name, HTTP requests per route so far, or None)."""
    if kind == "file":
        from kvbucket.stores.local.file import FileStore

        yield (lambda area: FileStore(tmp / "file-store" / area)), None
    elif kind == "s3":
        from kvbucket.stores.s3.store import S3Config, S3Store
        from kvbucket.testing.s3_server import SeaweedFS

        with SeaweedFS() as server:
            bucket = server.create_bucket()
            yield (lambda area: S3Store(S3Config.parse(server.config(bucket, area)))), None
    elif kind == "hf":
        from huggingface_hub import HfApi

        from kvbucket.stores.hub.open import open_hfbucket_store
        from kvbucket.testing import HubEmulator
        from kvbucket.testing.hub_fixtures import isolate_hf_env, restore_env

        saved = isolate_hf_env(tmp / "hf-home")  # hf_xet's caches must match this emulator's state
        token = "hf_bench_" + os.urandom(8).hex()
        try:
            with HubEmulator(tokens={"bench": (token, "write")}, data_dir=tmp / "hub") as emu:
                HfApi(endpoint=emu.endpoint, token=token).create_bucket("bench/compile-cache", private=True)

                def http() -> dict[str, int]:
                    routes = emu.stats()["routes"]
                    return {k: v["requests"] for k, v in routes.items() if k not in ("control", "telemetry")}

                def area(name: str) -> ObjectStore:
                    return open_hfbucket_store(f"hf://buckets/bench/compile-cache/{name}",
                                               endpoint=emu.endpoint, token=token, token_env="")

                if hub_latency_ms:  # every route but the emulator's control route, both cases alike
                    emu.faults.add("*", latency_s=hub_latency_ms / 1000)
                try:
                    yield area, http
                finally:
                    if hub_latency_ms:
                        emu.faults.reset()
        finally:
            restore_env(saved)
    else:
        raise SystemExit(f"unknown store {kind!r}; use file, s3 or hf")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def bench_store(kind: str, src: Path, tmp: Path, repeat: int, hub_latency_ms: float = 0.0) -> list[Row]:
    lay = NeuronLayout(VERSION)
    rows: dict[str, list[Row]] = {}
    with open_stores(kind, tmp, hub_latency_ms) as (open_area, http):
        for r in range(repeat):
            for case in ("kvbucket", "naive"):
                store = CountingStore(open_area(f"{case}-{r}"))
                dest = tmp / f"dest-{kind}-{case}-{r}"
                for phase in ("sync", "fetch", "fetch/files") if case == "kvbucket" else ("sync", "fetch"):
                    store.reset()
                    h0 = http() if http else {}
                    if case == "kvbucket" and phase == "sync":
                        sec, rep = timed(lambda s=store: sync(s, lay, src))
                        assert not rep.failed, rep.failed
                    elif case == "kvbucket" and phase == "fetch":
                        sec, rep = timed(lambda s=store, d=dest: fetch(s, lay, d, groups=[GROUP]))
                        assert not rep.failed and rep.pack_entries == len(rep.transferred), rep.summary()
                    elif case == "kvbucket":  # the same fetch without packs: batched per-file reads
                        d2 = tmp / f"dest-{kind}-files-{r}"
                        sec, rep = timed(lambda s=store, d=d2: fetch(s, lay, d, groups=[GROUP], packs=False))
                        assert not rep.failed and rep.packs == 0, rep.summary()
                        shutil.rmtree(d2, ignore_errors=True)
                    elif phase == "sync":
                        sec, _ = timed(lambda s=store: naive_sync(s, src))
                    else:
                        sec, _ = timed(lambda s=store, d=dest: naive_fetch(s, d))
                    calls = store.total_calls
                    routes = None
                    if http:
                        h1 = http()
                        routes = {k: n - h0.get(k, 0) for k, n in h1.items() if n - h0.get(k, 0)}
                    objs = sum(n for v, n in store.items.items() if v != "list") + store.calls["list"]
                    row = Row(kind, f"{case} {phase}", sec, calls, routes, objs)
                    rows.setdefault(row.case, []).append(row)
                shutil.rmtree(dest, ignore_errors=True)
                store.close()
    out = []
    for case, rs in rows.items():
        out.append(Row(kind, case, statistics.median(r.seconds for r in rs), rs[0].calls, rs[0].routes,
                       rs[0].objects))
    return out


def torch_ratio(tmp: Path, repeat: int, mode: str) -> tuple[float, float]:
    """Median compile seconds of a cold process and of a fresh one warmed from the bucket.

    The warm figure includes the fetch and load on enter. Each process has its own empty
    ``TORCHINDUCTOR_CACHE_DIR``; a FileStore target isolates the compile cache from store speed.
    """
    src = str(Path(__file__).resolve().parents[1] / "src")
    cold, warm = [], []
    for r in range(repeat):
        target = str(tmp / f"torch-bucket-{mode}-{r}")
        for label, sink in (("a", cold), ("b", warm)):
            env = {**os.environ, "PYTHONPATH": src,
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"ind-{mode}-{r}-{label}")}
            res = subprocess.run([sys.executable, "-m", "kvbucket.testing.torch_compile_probe", target,
                                  str(tmp / f"kv-{mode}-{r}-{label}"), "probe-mlp", mode], env=env,
                                 capture_output=True, text=True, check=True, cwd=tmp)
            body = json.loads(res.stdout.strip().splitlines()[-1])
            sink.append(body["seconds"] + (body["enter_seconds"] if label == "b" else 0.0))
    return statistics.median(cold), statistics.median(warm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", default="file,s3,hf")
    ap.add_argument("--entries", type=int, default=500)
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--neff-kib", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--hub-latency-ms", type=float, default=0.0, help="latency the Hub emulator adds to "
                    "every Hub and CAS request during the hf runs, for kvbucket and the baseline alike "
                    "(a stand-in for a remote Hub; default 0: loopback only)")
    ap.add_argument("--torch", action="store_true", help="also measure torch.compile cold vs warm")
    ap.add_argument("--tmp", default=None, help="where to put the caches and file stores (default: the "
                    "system temp dir); fetch ends with creating every file, whose cost is the file system's")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results import Results, add_argument

    add_argument(ap)
    args = ap.parse_args(argv)
    res = Results("bench_compile_cache", params=vars(args),
                  title="Compile cache: kvbucket's packs against a file-by-file baseline")
    tmp = Path(tempfile.mkdtemp(prefix="kvbucket-bench-cc-", dir=args.tmp))
    try:
        src = tmp / "src-cache"
        nbytes = build_cache(src, args.entries, args.files, args.neff_kib * 1024)
        nfiles = args.entries * args.files
        print(f"local cache: {args.entries} entries x {args.files} files = {nfiles} files, "
              f"{nbytes / 2**20:.1f} MiB, in {tmp.parent}")
        lat = (f"{args.hub_latency_ms:g} ms injected per Hub/CAS request (hf only, kvbucket and naive alike)"
               if args.hub_latency_ms else "none injected (loopback)")
        print(f"hub latency: {lat}")
        print(f"{'store':6} {'case':20} {'seconds':>9} {'store calls':>12} {'object reqs':>12} "
              f"{'HTTP reqs':>10}")
        for kind in [s for s in args.stores.split(",") if s]:
            try:
                rows = bench_store(kind, src, tmp, args.repeat, args.hub_latency_ms)
            except ImportError as e:
                print(f"{kind:6} not available here: {e}")
                continue
            by = {r.case: r for r in rows}
            for r in rows:
                res.run(store=r.store, case=r.case, seconds=r.seconds, store_calls=r.calls,
                        object_requests=r.objects, http_requests=r.http)
                http = "-" if r.http is None else str(r.http)
                print(f"{r.store:6} {r.case:20} {r.seconds:9.3f} {r.calls:12d} {r.objects:12d} {http:>10}")
                if r.routes:
                    by_route = ", ".join(f"{k} {n}" for k, n in sorted(r.routes.items()))
                    print(f"{'':28} HTTP by route: {by_route}")
            for phase, mine in (("sync", "sync"), ("fetch", "fetch"), ("fetch", "fetch/files")):
                k, n = by[f"kvbucket {mine}"], by[f"naive {phase}"]
                label = "packs" if mine == "fetch" else "per-file" if mine == "fetch/files" else ""
                line = (f"{kind:6} {phase:5} {label:8} naive/kvbucket: time x{n.seconds / k.seconds:.1f}, "
                        f"store calls x{n.calls / max(k.calls, 1):.0f}, "
                        f"object requests x{n.objects / max(k.objects, 1):.0f}")
                if k.routes is not None and n.routes is not None:
                    line += f", HTTP requests x{n.http / max(k.http or 0, 1):.1f}"
                    # hf_xet probes the global-dedup route per new file on its own; without those:
                    kd = (k.http or 0) - k.routes.get("dedup", 0)
                    nd = (n.http or 0) - n.routes.get("dedup", 0)
                    line += f" (x{nd / max(kd, 1):.1f} without hf_xet's dedup probes)"
                print(line)
                what = f"{kind}: {phase} {label}".strip()
                res.compare(f"{kind} {mine} time", f"{what} time", ours=k.seconds,
                            peer=n.seconds, peer_name=f"naive {phase}", unit="s", higher_is_better=False)
                res.compare(f"{kind} {mine} requests", f"{what} object requests", ours=k.objects,
                            peer=n.objects, peer_name=f"naive {phase}", unit="requests",
                            higher_is_better=False, goal=">= 10")
        if args.torch:
            for mode in ("artifacts", "inductor-dir"):
                cold, warm = torch_ratio(tmp, args.repeat, mode)
                print(f"torch.compile small MLP [{mode}]: cold {cold:.2f} s, warm (fetch + load + compile) "
                      f"{warm:.2f} s, cold/warm x{cold / warm:.1f}")
                res.compare(f"torch {mode}", f"torch.compile, small MLP [{mode}]", ours=warm,
                            ours_name="warm (fetch + load + compile)", peer=cold, peer_name="cold compile",
                            unit="s", higher_is_better=False)
        res.write(args.results_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
