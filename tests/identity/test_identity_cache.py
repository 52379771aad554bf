"""The machine's cache of weight digests (kvbucket.identity.local_cache): a restart reads no
weight byte (one stat per file), a changed stat hashes that file again (and only it),
concurrent processes share one cache file without losing or corrupting entries, a damaged file
is recomputed. Each computation below runs in a fresh process, as a restart does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvbucket.testing.redeploys import write_raw_safetensors

# Prints the identity token, the bytes hashed, and the seconds it took, in a fresh process.
SCRIPT = """
import json, sys, time
from kvbucket.identity import weights as w
hashed = []
real = w.hash_files
w.hash_files = lambda sizes: (hashed.append(sum(sizes.values())), real(sizes))[1]
from kvbucket.identity.core import identity_of_dir
out = {}
for p in sys.argv[1:]:
    t0 = time.perf_counter()
    tok = identity_of_dir(p, "org/m").token
    out[p] = {"token": tok, "seconds": time.perf_counter() - t0}
print(json.dumps({"ids": out, "hashed": sum(hashed)}))
"""
SHARD = 1 << 20


def settle() -> None:
    """Past kvbucket.identity.weights.RACY_NS: files changed before now are kept in the cache."""
    time.sleep(1.1)


def fresh(cache: Path | str, *dirs: Path) -> dict[str, Any]:
    env = {**os.environ, "KVBUCKET_IDENTITY_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, dirs)], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    return json.loads(out.stdout)


def model(root: Path, seed: int = 0, shards: int = 3) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    rng = np.random.default_rng(seed)
    for i in range(shards):
        write_raw_safetensors(root / f"model-{i}.safetensors", [(f"t{i}", rng.bytes(SHARD))])
    return root


def token(result: dict[str, Any], d: Path) -> str:
    return str(result["ids"][str(d)]["token"])


def test_a_restart_reads_no_weight_byte_and_a_changed_stat_hashes_that_file_again(tmp_path: Path) -> None:
    d, cache = model(tmp_path / "m"), tmp_path / "cache.json"
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    settle()
    first = fresh(cache, d)
    assert first["hashed"] == size and cache.is_file()
    again = fresh(cache, d)  # a restart: one stat per file
    assert again["hashed"] == 0 and token(again, d) == token(first, d)
    assert again["ids"][str(d)]["seconds"] < 0.5  # the benchmark measures it (well under 10 ms)
    shard = d / "model-1.safetensors"
    os.utime(shard, (1_000_000_000, 1_000_000_000))  # touched: hashed again, the same identity
    touched = fresh(cache, d)
    assert touched["hashed"] == shard.stat().st_size and token(touched, d) == token(first, d)
    with open(shard, "r+b") as f:  # a fine-tune written in place, mtime set back
        st = shard.stat()
        f.seek(SHARD // 2)
        f.write(b"\x55" * 4096)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    tuned = fresh(cache, d)
    assert tuned["hashed"] == shard.stat().st_size and token(tuned, d) != token(first, d)
    # changed under a second ago: hashed, not kept (a rewrite in the same tick could keep its stat)
    assert fresh(cache, d)["hashed"] == shard.stat().st_size
    settle()
    assert fresh(cache, d)["hashed"] == shard.stat().st_size  # kept now
    assert fresh(cache, d)["hashed"] == 0


def test_concurrent_processes_share_the_cache_without_corrupting_it(tmp_path: Path) -> None:
    dirs = [model(tmp_path / f"m{i}", seed=i, shards=2) for i in range(6)]
    cache = tmp_path / "cache.json"
    orders = [dirs[i:] + dirs[:i] for i in range(6)]  # each process starts with another model
    settle()
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda ds: fresh(cache, *ds), orders))
    tokens = {str(d): {token(r, d) for r in results} for d in dirs}
    assert all(len(t) == 1 for t in tokens.values()) and len({next(iter(t)) for t in tokens.values()}) == 6
    doc = json.loads(cache.read_text())  # whole, every file's digest in it
    assert len(doc["files"]) == 12
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".identity-")]  # no temporary left
    assert fresh(cache, *dirs)["hashed"] == 0


def test_a_damaged_cache_is_recomputed_and_rewritten(tmp_path: Path) -> None:
    d, cache = model(tmp_path / "m"), tmp_path / "cache.json"
    settle()
    first = fresh(cache, d)
    cache.write_text('{"version": 2, "files": {"/x": [1, 2')  # cut short
    again = fresh(cache, d)
    assert again["hashed"] > 0 and token(again, d) == token(first, d)
    assert len(json.loads(cache.read_text())["files"]) == 3


def test_the_cache_can_be_turned_off(tmp_path: Path) -> None:
    d = model(tmp_path / "m")
    assert fresh("off", d)["hashed"] > 0 and fresh("off", d)["hashed"] > 0
    assert not list(tmp_path.rglob("*.json.lock"))


def test_mapped_and_read_digests_agree(tmp_path: Path, monkeypatch: Any) -> None:
    """A file hashed from a mapping and one read with preadv (where it cannot be mapped) give one
    digest, over several segments and an empty file."""
    from kvbucket.identity import digest

    monkeypatch.setattr(digest, "SEGMENT", 1 << 16)
    f, empty = tmp_path / "w.bin", tmp_path / "empty.bin"
    f.write_bytes(np.random.default_rng(1).bytes(5 * (1 << 16) + 123))
    empty.write_bytes(b"")
    sizes = {str(f): f.stat().st_size, str(empty): 0}
    mapped = digest.hash_files(sizes)
    monkeypatch.setattr(digest.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("no mmap")))
    assert digest.hash_files(sizes) == mapped and mapped[str(f)] != mapped[str(empty)]


def test_a_restart_of_a_model_of_25000_files_reads_no_byte(tmp_path: Path) -> None:
    """Past the old bound of 20,000 entries, every restart hashed ~5,000 files again and rewrote
    the cache: a model is kept whole, so a restart reads no byte and writes nothing."""
    d = tmp_path / "many"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    for i in range(25_000):
        (d / f"w{i:05d}.safetensors").write_bytes(i.to_bytes(4, "little"))
    cache = tmp_path / "cache.json"
    settle()
    first = fresh(cache, d)
    assert first["hashed"] == 25_000 * 4
    written = cache.stat().st_mtime_ns
    again = fresh(cache, d)
    assert again["hashed"] == 0 and token(again, d) == token(first, d)
    assert cache.stat().st_mtime_ns == written  # nothing rewritten


def test_the_bound_drops_whole_model_directories_least_recently_written_first(
        tmp_path: Path, monkeypatch: Any) -> None:
    from kvbucket.identity import local_cache

    monkeypatch.setattr(local_cache, "MAX_ENTRIES", 5)
    c = local_cache.DigestCache(tmp_path / "cache.json")
    key = (1, 2, 3, 4)
    c.put_many({"/a/1": (key, "x"), "/a/2": (key, "x")}, group="/a")
    c.put_many({"/b/1": (key, "x"), "/b/2": (key, "x")}, group="/b")
    c.put_many({"/c/1": (key, "x"), "/c/2": (key, "x"), "/c/3": (key, "x")}, group="/c")  # 7 > 5: /a goes
    assert sorted(json.loads((tmp_path / "cache.json").read_text())["files"]) == [
        "/b/1", "/b/2", "/c/1", "/c/2", "/c/3"]
    big = {f"/d/{i}": (key, "x") for i in range(6)}  # one model over the bound: kept whole
    c.put_many(big, group="/d")
    assert sorted(json.loads((tmp_path / "cache.json").read_text())["files"]) == sorted(big)
