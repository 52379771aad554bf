"""What computing a model's identity costs at engine start (kvbucket.identity).

    PYTHONPATH=src python benchmarks/bench_identity.py [--gib 16] [--shards 4] [--dir /var/tmp/x]

Two cases, as an engine meets them:

- a resolved Hub commit (a Hub-cache snapshot ``.../snapshots/<commit>/``): the commit is read
  from the path, the config from ``config.json``; no weight byte is read;
- local weight files without one: an 8B model's bf16 weights, ``--shards`` safetensors files of
  ``--gib`` GiB in all. The files are sparse: a real safetensors header and real random bytes in
  the first MiB and in every 4 KiB block the fingerprint samples (the rest are holes, which a
  fingerprint never reads), so the reads hit the disk where a real model's would. Timed with a
  cold page cache (``echo 3 > /proc/sys/vm/drop_caches`` when permitted, else
  ``posix_fadvise(DONTNEED)`` on each file, which evicts a file's clean pages without root) and a
  warm one (a fresh computation; the per-process cache cleared). Repeated ``--repeat`` times.

The peer is reading the same files whole would cost: their size at the disk's measured read
rate is not measured here (16 GiB); the figure is what the sample reads cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvbucket.identity import weights as w
from kvbucket.identity.core import identity_of_dir
from results import Results, add_argument

CONFIG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
          "rope_theta": 500000.0, "torch_dtype": "bfloat16",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def sparse_shard(path: Path, size: int, seed: int) -> None:
    """A safetensors file of ``size`` bytes: real bytes where the fingerprint reads, holes elsewhere."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [(size - 4096) // 2],
                               "data_offsets": [0, (size - 4096) // 2 * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    rng = os.urandom
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(rng(w.HEAD_BYTES - f.tell()))
        span = size - w.HEAD_BYTES - w.SAMPLE_BYTES
        for i in range(w.SAMPLES):
            f.seek(w.HEAD_BYTES + (span * i) // (w.SAMPLES - 1))
            f.write(rng(w.SAMPLE_BYTES))
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(files: list[Path]) -> str:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(DONTNEED)"


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to make the files (default: a temp dir)")
    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_identity", params=vars(args), title="Model identity at engine start")
    root = Path(tempfile.mkdtemp(prefix="kvb-ident-", dir=args.dir))
    try:
        local = root / "local" / "llama-8b"
        local.mkdir(parents=True)
        (local / "config.json").write_text(json.dumps(CONFIG))
        size = int(args.gib * 2**30) // args.shards
        files = []
        for i in range(args.shards):
            f = local / f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
            sparse_shard(f, size, i)
            files.append(f)
        on_disk = sum(os.stat(f).st_blocks * 512 for f in files)
        snap = root / "hub" / "models--org--llama-8b" / "snapshots" / ("c" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(CONFIG))
        for f in files:  # the Hub cache's snapshot files are symlinks to blobs
            (snap / f.name).symlink_to(f)
        hub, cold, warm = [], [], []
        how = ""
        for r in range(args.repeat):
            w._cache.clear()
            hub.append(timed(lambda: identity_of_dir(snap, "org/llama-8b")))
            assert identity_of_dir(snap, "org/llama-8b").weights == "hub:" + "c" * 40
            how = drop_cache(files)
            w._cache.clear()
            cold.append(timed(lambda: identity_of_dir(local, "org/llama-8b")))
            w._cache.clear()
            warm.append(timed(lambda: identity_of_dir(local, "org/llama-8b")))
            again = timed(lambda: identity_of_dir(local, "org/llama-8b"))  # cached in the process
            res.run(round=r + 1, hub_commit_s=hub[-1], files_cold_s=cold[-1], files_warm_s=warm[-1],
                    files_cached_s=again)
            print(f"round {r + 1}: hub commit {hub[-1] * 1e3:.2f} ms, files cold {cold[-1] * 1e3:.1f} ms "
                  f"({how}), warm {warm[-1] * 1e3:.2f} ms, cached {again * 1e6:.0f} us")
        total = size * args.shards
        print(f"{args.shards} shards, {total / 2**30:.1f} GiB apparent, {on_disk / 2**20:.1f} MiB on disk; "
              f"cold cache by {how}")
        res.figure("hub_commit", statistics.median(hub), "s", label="resolved Hub commit (goal < 0.1 s)")
        res.figure("files_cold", statistics.median(cold), "s", label=f"{args.gib:g} GiB local files, cold")
        res.figure("files_warm", statistics.median(warm), "s", label=f"{args.gib:g} GiB local files, warm")
        res.run(cold_cache=how, apparent_bytes=total, on_disk_bytes=on_disk)
        res.write()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
