"""Local tiers against this machine's own ceilings, measured in the same run.

    PYTHONPATH=src python benchmarks/bench_local.py [--chunks 256] [--chunk-mib 2] [--repeat 5] [--fsync]

Every case moves the same ``chunks`` buffers of ``chunk-mib`` MiB: ``put`` stores them all,
``get`` reads them all back into preallocated buffers (as an inference engine reads into its
KV buffers). Two ceilings are measured alongside:

- ``memcpy``: copy the bytes into / out of preallocated memory (the bound for memory tiers);
- ``plain file``: one file per chunk with ``open/write`` and ``open/readinto`` in a temp dir on
  the same filesystem as the file-backed cases (the bound for disk tiers).

Each case reports GiB/s and its ratio to its ceiling. Cases run round-robin ``--repeat`` times
(alternating the order) and the median is kept, so drift on a shared machine hits every case
alike. With ``--fsync``
both the plain-file ceiling and FileStore fsync every file (FileStore also fsyncs the
directory after the rename: that is the price of its durability, and it is counted). Reads come
from the page cache for every file case alike (the data was just written).

To add a row (e.g. a backend), append a :class:`Case` in :func:`build_cases`: a name, the
ceiling it is compared with, and put/get/reset callables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.stores.local.file import FileStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Results, add_argument
from unsealed import Unsealed

MIB = 1024 * 1024
UNSEALED_DISK = "LocalDiskBackend (unsealed)"
GIB = 1024 * MIB
MEMCPY, PLAIN_FILE = "memcpy", "plain file"


@dataclass
class Case:
    """One row: ``put(chunks)`` stores every chunk, ``get(outs)`` reads them all back.

    ``reset`` runs untimed after each get, so every repetition starts from an empty tier and
    leaves no dirty pages behind to be written back during the next case's timing;
    ``baseline`` names the ceiling row the ratio is taken against (``None`` for a ceiling).
    """

    name: str
    put: Callable[[Sequence[bytes]], None]
    get: Callable[[Sequence[bytearray]], None]
    reset: Callable[[], None] = lambda: None
    baseline: str | None = None
    put_secs: list[float] = field(default_factory=list)
    get_secs: list[float] = field(default_factory=list)


def memcpy_case(n: int, size: int) -> Case:
    slots = [bytearray(size) for _ in range(n)]

    def put(chunks: Sequence[bytes]) -> None:
        for slot, c in zip(slots, chunks, strict=True):
            slot[:] = c

    def get(outs: Sequence[bytearray]) -> None:
        for out, slot in zip(outs, slots, strict=True):
            out[:] = slot

    return Case(MEMCPY, put, get)


def plain_file_case(root: Path, fsync: bool) -> Case:
    root.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []

    def put(chunks: Sequence[bytes]) -> None:
        paths[:] = [os.path.join(root, f"c{i}") for i in range(len(chunks))]
        for p, c in zip(paths, chunks, strict=True):
            with open(p, "wb") as f:
                f.write(c)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def get(outs: Sequence[bytearray]) -> None:
        for p, out in zip(paths, outs, strict=True):
            with open(p, "rb", buffering=0) as f:
                if f.readinto(out) != len(out):
                    raise RuntimeError(f"short read from {p}")

    return Case(PLAIN_FILE, put, get, reset=lambda: _empty_dir(root))


def file_store_case(root: Path, fsync: bool, batch: int) -> Case:
    store = FileStore(root, fsync=fsync)
    names: list[str] = []

    def put(chunks: Sequence[bytes]) -> None:
        names[:] = [f"c{i}" for i in range(len(chunks))]
        for i in range(0, len(chunks), batch):
            for r in store.put_many(list(zip(names[i : i + batch], chunks[i : i + batch], strict=True))):
                if r.error is not None:
                    raise r.error

    def get(outs: Sequence[bytearray]) -> None:
        for i in range(0, len(outs), batch):
            for r in store.get_many(names[i : i + batch], outs[i : i + batch]):
                if not r.found:
                    raise RuntimeError(f"{r.name}: {r.error or 'missing'}")

    def reset() -> None:
        store.delete_many(names)

    return Case(f"FileStore (batches of {batch})", put, get, reset=reset, baseline=PLAIN_FILE)


def backend_case(
    name: str,
    backend: StorageBackend | Callable[[], StorageBackend],
    baseline: str,
    batch: int,
) -> Case:
    """A storage backend: blocking ``batched_put``, then ``batched_get_into`` the engine's buffers.

    Given a factory instead of a backend, every repetition starts from a brand-new backend
    (a cold tier that must allocate all its memory).
    """
    factory = backend if callable(backend) and not isinstance(backend, StorageBackend) else None
    if factory is not None:
        backend = factory()
    assert isinstance(backend, StorageBackend)
    keys: list[str] = []

    def put(chunks: Sequence[bytes]) -> None:
        keys[:] = [f"bench@1@0@{i:x}@bfloat16" for i in range(len(chunks))]
        for i in range(0, len(chunks), batch):
            part = list(zip(keys[i : i + batch], chunks[i : i + batch], strict=True))
            if backend.batched_put(part) != len(part):
                raise RuntimeError(f"{name}: a put failed")

    def get(outs: Sequence[bytearray]) -> None:
        for i in range(0, len(outs), batch):
            if not all(backend.batched_get_into(keys[i : i + batch], outs[i : i + batch])):
                raise RuntimeError(f"{name}: a chunk was missing")

    def reset() -> None:
        nonlocal backend
        if factory is not None:
            backend.close()
            backend = factory()
            return
        for k in keys:
            backend.remove(k)

    return Case(name, put, get, reset=reset, baseline=baseline)


def build_cases(workdir: Path, n: int, size: int, fsync: bool) -> list[Case]:
    """The rows of the table. Ceilings first; each other row names the ceiling it is held to."""
    room = n * size + size  # every chunk fits: the rows measure the tier, not its evictions
    return [
        memcpy_case(n, size),
        plain_file_case(workdir / "plain", fsync),
        file_store_case(workdir / "filestore", fsync, batch=32),
        backend_case("LocalCPUBackend", LocalCPUBackend(room), MEMCPY, batch=32),
        backend_case("LocalCPUBackend (cold)", lambda: LocalCPUBackend(room), MEMCPY, batch=32),
        backend_case("LocalDiskBackend", LocalDiskBackend(workdir / "disk", room, fsync=fsync), PLAIN_FILE,
                     batch=32),
        # Verification off: the same tier over a store without the envelope (benchmarks/unsealed.py).
        backend_case(UNSEALED_DISK,
                     LocalDiskBackend(Unsealed(FileStore(workdir / "disk-raw", fsync=fsync)), room),
                     PLAIN_FILE, batch=32),
        backend_case("RemoteBackend (FileStore)",
                     RemoteBackend(FileStore(workdir / "remote", fsync=fsync), _layout(size)), PLAIN_FILE,
                     batch=32),
    ]


def _layout(size: int) -> KVLayout:
    """A KV layout whose full chunk is ``size`` bytes (the remote tier only takes full chunks)."""
    if size % 512:
        raise SystemExit("--chunk-mib must give a multiple of 512 bytes for the RemoteBackend row")
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=1, dtype="uint8", chunk_tokens=size // 2)


def _empty_dir(root: Path) -> None:
    for p in root.iterdir():
        p.unlink()


def run(cases: list[Case], chunks: Sequence[bytes], repeat: int) -> None:
    outs = [bytearray(len(c)) for c in chunks]
    for rep in range(repeat):
        # Alternate the order so that no case always runs right after the same neighbour.
        for case in cases if rep % 2 == 0 else cases[::-1]:
            t0 = time.perf_counter()
            case.put(chunks)
            t1 = time.perf_counter()
            for o, c in zip(outs, chunks, strict=True):  # a get that writes nothing fails the check
                o[0] = c[0] ^ 0xFF
            t2 = time.perf_counter()
            case.get(outs)
            t3 = time.perf_counter()
            if any(o != c for o, c in zip(outs, chunks, strict=True)):
                raise SystemExit(f"{case.name}: bytes read back differ from the bytes stored")
            case.put_secs.append(t1 - t0)
            case.get_secs.append(t3 - t2)
            # Untimed: remove what this case wrote, so its dirty pages are dropped rather than
            # written back while the next case is being timed.
            case.reset()


def report(cases: list[Case], total_bytes: int) -> str:
    def rate(secs: list[float]) -> float:
        return total_bytes / statistics.median(secs) / GIB

    by_name = {c.name: c for c in cases}
    lines = [f"{'case':<28} {'put GiB/s':>10} {'get GiB/s':>10} {'put ratio':>10} {'get ratio':>10}  vs"]
    for c in cases:
        put, get = rate(c.put_secs), rate(c.get_secs)
        if c.baseline is None:
            lines.append(f"{c.name:<28} {put:>10.2f} {get:>10.2f} {'(ceiling)':>10} {'':>10}")
            continue
        b = by_name[c.baseline]
        pr, gr = put / rate(b.put_secs), get / rate(b.get_secs)
        lines.append(f"{c.name:<28} {put:>10.2f} {get:>10.2f} {pr:>10.2f} {gr:>10.2f}  {c.baseline}")
    if "LocalDiskBackend" in by_name and UNSEALED_DISK in by_name:
        on, off = by_name["LocalDiskBackend"], by_name[UNSEALED_DISK]
        lines.append(
            f"disk tier, verification on / off: get {rate(on.get_secs) / rate(off.get_secs):.3f}, "
            f"put {rate(on.put_secs) / rate(off.put_secs):.3f} (envelope + xxh3-64 checksum); "
            f"paired by repetition: get {_paired(off.get_secs, on.get_secs)}, "
            f"put {_paired(off.put_secs, on.put_secs)}"
        )
    return "\n".join(lines)


def record(res: Results, cases: list[Case], total_bytes: int) -> None:
    """Per-repetition GiB/s of every case, and each tier's median put/get against its ceiling."""
    def rate(secs: list[float]) -> float:
        return total_bytes / statistics.median(secs) / GIB

    by_name = {c.name: c for c in cases}
    for c in cases:
        for i, (p, g) in enumerate(zip(c.put_secs, c.get_secs, strict=True)):
            res.run(case=c.name, repetition=i, put_gibs=total_bytes / p / GIB, get_gibs=total_bytes / g / GIB)
    for c in cases:
        if c.baseline is None:
            continue
        b = by_name[c.baseline]
        goal = ">= 0.5" if c.baseline == MEMCPY else ">= 0.7"
        for op, ours, peer in (("put", c.put_secs, b.put_secs), ("get", c.get_secs, b.get_secs)):
            res.compare(f"{c.name} {op}", f"{c.name} {op}", ours=rate(ours), peer=rate(peer),
                        peer_name=c.baseline, ours_name=c.name, unit="GiB/s", goal=goal,
                        ratios=[q / t for q, t in zip(peer, ours, strict=True) if t > 0])
    if "LocalDiskBackend" in by_name and UNSEALED_DISK in by_name:
        on, off = by_name["LocalDiskBackend"], by_name[UNSEALED_DISK]
        for op, a, b2 in (("get", on.get_secs, off.get_secs), ("put", on.put_secs, off.put_secs)):
            res.compare(f"verification {op}", f"disk tier {op}, verification on vs off",
                        ours=rate(a), peer=rate(b2), peer_name="LocalDiskBackend (unsealed)",
                        ours_name="LocalDiskBackend (sealed)", unit="GiB/s", goal=">= 0.95",
                        ratios=[q / t for q, t in zip(b2, a, strict=True) if t > 0])


def _paired(base: list[float], secs: list[float]) -> str:
    """Median (and range) of the per-repetition throughput ratios: both cases ran in the same
    repetition, one after the other, so drift between repetitions cancels."""
    ratios = sorted(b / t for b, t in zip(base, secs, strict=True) if t > 0)
    return f"{statistics.median(ratios):.3f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]" if ratios else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fsync", action="store_true", help="fsync every file (ceiling and stores alike)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: the system temp dir)")
    add_argument(ap)
    args = ap.parse_args(argv)
    res = Results("bench_local", params=vars(args),
                  title="Local tiers against this machine's memcpy and plain-file ceilings")

    size = int(args.chunk_mib * MIB)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(args.chunks)]
    workdir = Path(tempfile.mkdtemp(prefix="kvbucket-bench-", dir=args.dir))
    try:
        cases = build_cases(workdir, args.chunks, size, args.fsync)
        run(cases, chunks, args.repeat)
        total = args.chunks * size
        print(
            f"{args.chunks} chunks x {args.chunk_mib:g} MiB = {total / GIB:.2f} GiB per pass, median of "
            f"{args.repeat}, fsync={'on' if args.fsync else 'off'}, dir={workdir.parent}, "
            f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
        )
        print(report(cases, total))
        record(res, cases, total)
        res.write(args.results_dir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
