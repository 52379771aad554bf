"""What a model's identity costs (kvbucket.identity): once per machine, at a restart, per request.

    PYTHONPATH=src python benchmarks/bench_identity.py [--gib 4] [--shards 4] [--dir /work/tmp-id38]

An 8B-class model's bf16 weights as ``--shards`` safetensors files of ``--gib`` GiB in all: real
files (every byte written, nothing sparse; random 256 MiB blocks, each shard's differing), under
a local directory, and the same files as a Hub-cache snapshot. Measured, ``--repeat`` times:

- ``hub_commit``: a Hub cache snapshot (``models--*/snapshots/<commit>/``, files symlinked into
  ``blobs/``): the commit from the layout, no byte read;
- ``files_cold``: the first computation on a machine with a cold page cache (``echo 3 >
  /proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` per file, which evicts a
  file's clean pages without root): the disk bounds it;
- ``files_warm``: the first computation with the files in the page cache (the engine has just
  loaded them), the digest cache emptied: every byte hashed (XXH3-128, several threads);
- ``restart``: a fresh process with the machine's digest cache (one ``stat`` per file, no byte
  read), timed inside the process (the interpreter's own start is not the identity's);
- ``per_request``: what a request pays once the identity is known: ``IdentitySetting.token``
  and ``IdentitySetting.unknown`` (dict lookups), per call.

The 16 GiB projection is ``files_warm`` scaled by bytes (the hash is linear in them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvbucket.identity import local_cache
from kvbucket.identity import weights as w
from kvbucket.identity.core import IdentitySetting, identity_of_dir
from kvbucket.testing.redeploys import write_raw_safetensors
from results import Results, add_argument

CONFIG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
          "rope_theta": 500000.0, "torch_dtype": "bfloat16",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
BLOCK = 256 << 20
RESTART = """
import sys, time
t0 = time.perf_counter()
from kvbucket.identity.core import identity_of_dir
t1 = time.perf_counter()
identity_of_dir(sys.argv[1], "org/llama-8b")
print(time.perf_counter() - t1, t1 - t0)
"""


def write_shards(local: Path, total: int, shards: int) -> list[Path]:
    """Real safetensors shards of ``total`` bytes in all (random bytes, fsynced)."""
    block = os.urandom(BLOCK)
    size = total // shards
    files = []
    for i in range(shards):
        f = local / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        lengths = [min(BLOCK, size - off) for off in range(0, size, BLOCK)]
        tensors = [(f"layers.{i}.t{j}", bytes([i, j % 256]) + block[2:n]) for j, n in enumerate(lengths)]
        write_raw_safetensors(f, tensors)
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        files.append(f)
    return files


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


def fresh_start(cache: Path) -> None:
    """As a machine that never saw the files: no digest cache on disk, none in the process."""
    cache.unlink(missing_ok=True)
    local_cache.reset()
    w._jobs.clear()


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to make the files (default: a temp dir)")
    add_argument(ap)
    args = ap.parse_args()
    res = Results("bench_identity", params=vars(args), title="Model identity: once per machine, at a restart")
    root = Path(tempfile.mkdtemp(prefix="kvb-ident-", dir=args.dir))
    cache = root / "identity-weights.json"
    os.environ[local_cache.ENV] = str(cache)
    try:
        local = root / "local" / "llama-8b"
        local.mkdir(parents=True)
        (local / "config.json").write_text(json.dumps(CONFIG))
        files = write_shards(local, int(args.gib * 2**30), args.shards)
        time.sleep(1.1)  # older than weights.RACY_NS: their digests are kept in the machine's cache
        total = sum(f.stat().st_size for f in files)
        on_disk = sum(os.stat(f).st_blocks * 512 for f in files)
        repo = root / "hub" / "models--org--llama-8b"
        snap = repo / "snapshots" / ("c" * 40)
        snap.mkdir(parents=True)
        (repo / "blobs").mkdir()
        (repo / "blobs" / "config").write_text(json.dumps(CONFIG))
        (snap / "config.json").symlink_to("../../blobs/config")
        for f in files:  # the Hub cache's snapshot files are symlinks to blobs (here, to the files)
            (repo / "blobs" / f.name).symlink_to(f)
            (snap / f.name).symlink_to(f"../../blobs/{f.name}")
        hub, cold, warm, restart, restart_import = [], [], [], [], []
        how = ""
        token = identity_of_dir(local, "org/llama-8b").token
        for r in range(args.repeat):
            hub.append(timed(lambda: identity_of_dir(snap, "org/llama-8b")))
            assert identity_of_dir(snap, "org/llama-8b").weights == "hub:" + "c" * 40
            fresh_start(cache)
            how = drop_cache(files)
            cold.append(timed(lambda: identity_of_dir(local, "org/llama-8b")))
            fresh_start(cache)  # the files are in the page cache now
            warm.append(timed(lambda: identity_of_dir(local, "org/llama-8b")))
            assert identity_of_dir(local, "org/llama-8b").token == token
            out = subprocess.run([sys.executable, "-c", RESTART, str(local)], capture_output=True, text=True,
                                 check=True, env={**os.environ, local_cache.ENV: str(cache)}).stdout.split()
            restart.append(float(out[0]))
            restart_import.append(float(out[1]))
            res.run(round=r + 1, hub_commit_s=hub[-1], files_cold_s=cold[-1], files_warm_s=warm[-1],
                    restart_s=restart[-1])
            print(f"round {r + 1}: hub commit {hub[-1] * 1e3:.2f} ms, cold {cold[-1]:.2f} s ({how}), "
                  f"warm {warm[-1]:.2f} s, restart {restart[-1] * 1e3:.2f} ms "
                  f"(+{restart_import[-1] * 1e3:.0f} ms to import kvbucket.identity)")
        setting = IdentitySetting(str(local))
        assert setting.wait(60)
        n = 200_000
        per_token = timed(lambda: [setting.token("org/llama-8b") for _ in range(n)]) / n
        per_unknown = timed(lambda: [setting.unknown(1) for _ in range(n)]) / n
        gib = total / 2**30
        warm_s = statistics.median(warm)
        print(f"{args.shards} shards, {gib:.2f} GiB ({on_disk / 2**30:.2f} GiB on disk); cold by {how}; "
              f"warm {gib / warm_s:.1f} GiB/s -> 16 GiB warm {warm_s * 16 / gib:.2f} s; per request "
              f"token() {per_token * 1e9:.0f} ns, unknown() {per_unknown * 1e9:.0f} ns")
        res.figure("hub_commit", statistics.median(hub), "s", label="resolved Hub commit (no byte read)")
        res.figure("files_cold", statistics.median(cold), "s", label=f"{gib:g} GiB local files, cold ({how})")
        res.figure("files_warm", warm_s, "s", label=f"{gib:g} GiB local files, warm (page cache)")
        res.figure("warm_gibs", gib / warm_s, "GiB/s", label="hash rate, warm")
        res.figure("projected_16gib_warm", warm_s * 16 / gib, "s",
                   label="16 GiB warm, projected (goal < 3 s)")
        res.figure("cold_gibs", gib / statistics.median(cold), "GiB/s", label="read+hash rate, cold")
        res.figure("restart", statistics.median(restart), "s",
                   label="restart with the digest cache (goal < 10 ms)")
        res.figure("per_request_token", per_token * 1e9, "ns", label="per request: IdentitySetting.token()")
        res.figure("per_request_unknown", per_unknown * 1e9, "ns",
                   label="per request: IdentitySetting.unknown()")
        res.run(cold_cache=how, bytes=total, on_disk_bytes=on_disk)
        res.write(args.results_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
