"""Whole-client flows: restart durability, concurrent uploads, a multi-xorb object, sync, HfFileSystem."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from huggingface_hub import HfApi, HfFileSystem

from kvbucket.testing import HubEmulator
from kvbucket.testing.hub_fixtures import HubBucket, RunningHub


def test_restart_keeps_every_file(hub_emulator: RunningHub, tmp_path: Path) -> None:
    """A second server on its own data dir; stopped and started again, it still serves everything."""
    tokens = {"u": ("restart-secret", "write")}
    blobs = {f"r/{i}": os.urandom(n) for i, n in enumerate([0, 1, 70_000, 1_500_000])}
    with HubEmulator(tmp_path / "data", tokens) as emu:
        api = HfApi(endpoint=emu.endpoint, token="restart-secret")
        api.create_bucket("u/durable", private=True)
        api.batch_bucket_files("u/durable", add=[(d, p) for p, d in blobs.items()])
        before = {f.path: f.xet_hash for f in api.list_bucket_tree("u/durable", recursive=True)}
        emu.restart()
        after = {f.path: f.xet_hash for f in api.list_bucket_tree("u/durable", recursive=True)}
        assert after == before and set(after) == set(blobs)
        api.download_bucket_files("u/durable", [(p, tmp_path / "out" / p) for p in blobs])
        for p, d in blobs.items():
            assert (tmp_path / "out" / p).read_bytes() == d
        assert api.bucket_info("u/durable").private is True
    # no temp files were left behind by the atomic writes
    assert not [p for p in (tmp_path / "data").rglob(".tmp-*")]


_CLIENT_SCRIPT = """
import os, sys
from huggingface_hub import HfApi
endpoint, bucket, src, dest = sys.argv[1:5]
api = HfApi(endpoint=endpoint, token=os.environ["KVB_TEST_TOKEN"])
sys.stdin.readline()  # start together with the other client
api.batch_bucket_files(bucket, add=[(src, dest)])
print("done")
"""


def test_two_clients_upload_the_same_content_at_once(hub_bucket: HubBucket, tmp_path: Path) -> None:
    """One client in this process, one in a child process with its own Xet cache: no shared dedup."""
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    src = tmp_path / "same.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    home = tmp_path / "other-home"
    env = {**os.environ, "HF_HOME": str(home), "HF_XET_CACHE": str(home / "xet")}
    env["KVB_TEST_TOKEN"] = hub_bucket.hub.write_token
    child = subprocess.Popen(
        [sys.executable, "-c", _CLIENT_SCRIPT, hub_bucket.hub.endpoint, bid, str(src), "same/1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            api.batch_bucket_files(bid, add=[(str(src), "same/0")])
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=upload)
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    t.start()
    out, err = child.communicate(timeout=120)
    t.join()
    assert child.returncode == 0 and out.strip() == "done", err[-2000:]
    assert errors == []
    infos = list(api.get_bucket_paths_info(bid, ["same/0", "same/1"]))
    assert len(infos) == 2 and infos[0].xet_hash == infos[1].xet_hash
    api.download_bucket_files(bid, [("same/0", tmp_path / "a"), ("same/1", tmp_path / "b")])
    assert (tmp_path / "a").read_bytes() == src.read_bytes() == (tmp_path / "b").read_bytes()


def test_object_over_64_mib_spans_several_xorbs(hub_bucket: HubBucket, tmp_path: Path) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    src = tmp_path / "big.bin"
    rng = np.random.default_rng(7)
    # fp16-like values (compressible by byte grouping) followed by raw random bytes
    half = rng.standard_normal(9 * 1024 * 1024, dtype=np.float32).astype(np.float16).tobytes()
    src.write_bytes(half + rng.bytes(66 * 1024 * 1024 - len(half) + 12345))
    before = hub_bucket.hub.stats()["routes"].get("xorb_upload", {}).get("requests", 0)
    api.batch_bucket_files(bid, add=[(str(src), "big.bin")])
    assert hub_bucket.hub.stats()["routes"]["xorb_upload"]["requests"] - before >= 2
    (info,) = api.get_bucket_paths_info(bid, ["big.bin"])
    assert info.size == src.stat().st_size
    api.download_bucket_files(bid, [("big.bin", tmp_path / "back.bin")])
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    # a range read that crosses the xorb boundary, served by the resolve route
    fs = HfFileSystem(endpoint=hub_bucket.hub.endpoint, token=hub_bucket.hub.write_token)
    with fs.open(f"buckets/{bid}/big.bin", "rb", block_size=1 << 20) as f:
        off = 64 * 1024 * 1024 - 1000
        f.seek(off)
        assert f.read(5000) == src.read_bytes()[off : off + 5000]
    # a 20 MiB range: the resolve route reads it in several windows, across the xorb boundary
    a, b = 46 * 1024 * 1024 + 7, 66 * 1024 * 1024 - 3
    assert fs.cat_file(f"buckets/{bid}/big.bin", start=a, end=b) == src.read_bytes()[a:b]


def test_sync_bucket_both_ways(hub_bucket: HubBucket, tmp_path: Path) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    up = tmp_path / "up"
    files = {"a.txt": b"alpha", "sub/b.bin": os.urandom(200_000), "sub/deep/c": b""}
    files["m%2Fx@1@0@ab@bf16"] = b"k"
    for rel, d in files.items():
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_bytes(d)
    api.sync_bucket(str(up), f"hf://buckets/{bid}/mirror", quiet=True)
    listed = {f.path: f.size for f in api.list_bucket_tree(bid, prefix="mirror", recursive=True)}
    assert listed == {f"mirror/{k}": len(v) for k, v in files.items()}
    down = tmp_path / "down"
    api.sync_bucket(f"hf://buckets/{bid}/mirror", str(down), quiet=True)
    for rel, d in files.items():
        assert (down / rel).read_bytes() == d
    # delete a local file and sync with delete=True: the bucket follows
    (up / "a.txt").unlink()
    api.sync_bucket(str(up), f"hf://buckets/{bid}/mirror", delete=True, quiet=True)
    assert "mirror/a.txt" not in {f.path for f in api.list_bucket_tree(bid, prefix="mirror", recursive=True)}


def test_hffilesystem_ls_info_open_seek_read(hub_bucket: HubBucket) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    data = os.urandom(300_000)
    api.batch_bucket_files(bid, add=[(data, "fs/data.bin"), (b"x", "fs/dir/y.txt"), (b"z", "fs%2Fz@1")])
    fs = HfFileSystem(endpoint=hub_bucket.hub.endpoint, token=hub_bucket.hub.write_token)
    root = f"buckets/{bid}"
    names = {(e["name"], e["type"]) for e in fs.ls(f"{root}/fs", detail=True)}
    assert names == {(f"{root}/fs/data.bin", "file"), (f"{root}/fs/dir", "directory")}
    assert fs.info(f"{root}/fs/data.bin")["size"] == len(data)
    assert fs.info(f"{root}/fs/dir")["type"] == "directory"
    assert fs.isfile(f"{root}/fs%2Fz@1") and fs.cat(f"{root}/fs%2Fz@1") == b"z"
    with fs.open(f"{root}/fs/data.bin", "rb", block_size=4096) as f:
        f.seek(123_456)
        assert f.read(1000) == data[123_456:124_456]
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:]
        f.seek(0)
        assert f.read(5) == data[:5]
    with fs.open(f"{root}/fs/data.bin", "rb") as f:
        assert f.read() == data
    assert fs.cat_file(f"{root}/fs/data.bin", start=70_000, end=70_100) == data[70_000:70_100]
    assert sorted(fs.find(root)) == sorted(f"{root}/{p}" for p in ["fs/data.bin", "fs/dir/y.txt", "fs%2Fz@1"])


def test_uploads_without_zero_copy(tmp_path: Path) -> None:
    """The portable receive path (no splice) gives the same result through the real client."""
    data = os.urandom(5 * 1024 * 1024)
    with HubEmulator(tmp_path / "d", zero_copy=False) as emu:
        assert emu.stats()["zero_copy_uploads"] is False
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/nozc")
        api.batch_bucket_files("local/nozc", add=[(data, "x")])
        api.download_bucket_files("local/nozc", [("x", tmp_path / "x")])
        assert (tmp_path / "x").read_bytes() == data
