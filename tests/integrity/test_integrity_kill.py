"""A writer killed in the middle of a store never leaves a chunk that loads as good.

The writer is a child process (SIGKILL while the bytes are in flight): the disk tier's temp file
+ rename, an S3 multipart upload on SeaweedFS, and a Hugging Face bucket's Xet upload and batch
commit on the Hub emulator. Afterwards the name holds nothing or the old
good chunk, and every read through the tiers is verified.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.keys import key_to_name
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store

BIG = KVLayout(num_layers=64, num_kv_heads=8, head_size=128, dtype="bfloat16", chunk_tokens=512)  # 64 MiB

DISK_WRITER = """
import sys, numpy as np
from kvbucket.backends.local_disk import LocalDiskBackend
with LocalDiskBackend(sys.argv[1], 1 << 34) as d:
    print("ready", flush=True)
    for i in range(1000):  # rewrite the same key again and again: a kill lands mid-write
        d.put("k@1@0@1@bfloat16", np.full(int(sys.argv[2]), i % 200 + 1, dtype=np.uint8))
"""


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_disk_tier_writer_killed_mid_write(tmp_path: Path) -> None:
    size = 32 << 20
    for _ in range(3):
        proc = _spawn(DISK_WRITER, str(tmp_path), str(size))
        tmp = tmp_path / ".kvbucket-tmp"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until a temp file is being written
            if tmp.is_dir() and any(0 < p.stat().st_size < size for p in tmp.iterdir() if p.is_file()):
                break
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with LocalDiskBackend(tmp_path, 1 << 34) as d:
            got = d.get("k@1@0@1@bfloat16")
            if got is not None:  # the last complete copy: one fill byte all through, full size
                arr = np.frombuffer(got, dtype=np.uint8)
                assert arr.size == size and (arr == arr[0]).all() and arr[0] != 0


S3_WRITER = """
import json, sys, numpy as np
from kvbucket.stores.s3.store import S3Store
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.guard.sealed import seal_store
parts = {"s3_multipart_threshold": 5 << 20, "s3_multipart_part_size": 5 << 20}
cfg = S3Config.parse({**json.loads(sys.argv[1]), **parts})
store = seal_store(S3Store(cfg), tier="remote")
print("ready", flush=True)
store.put(sys.argv[2], np.full(int(sys.argv[3]), 7, dtype=np.uint8))
print("done", flush=True)
"""


def test_s3_multipart_writer_killed_mid_upload(seaweedfs, s3_bucket) -> None:
    import json

    cfg = seaweedfs.config(s3_bucket)
    name = key_to_name("org/model@1@0@7@bfloat16")
    proc = _spawn(S3_WRITER, json.dumps(cfg), name, str(BIG.full_chunk_bytes))
    client = seaweedfs.client()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # some parts uploaded, the upload not completed
        ups = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        if ups and client.list_parts(Bucket=s3_bucket, Key=ups[0]["Key"],
                                     UploadId=ups[0]["UploadId"]).get("Parts"):
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the writer never started a multipart upload")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    with RemoteBackend(S3Store(S3Config.parse(cfg)), BIG, exists_cache_ttl_secs=0) as b:
        assert not b.contains("org/model@1@0@7@bfloat16")
        assert b.get("org/model@1@0@7@bfloat16") is None
    assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket)  # nothing visible under any name


HF_WRITER = """
import sys, numpy as np
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.guard.sealed import seal_store
endpoint, token, bucket, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = build_config(bucket_handle=f"hf://buckets/{bucket}", token=token, token_env="", endpoint=endpoint,
                   store_timeout_secs=60.0)
store = seal_store(HFBucketStore(cfg), tier="remote")
print("ready", flush=True)
store.put_many([(f"c{i}", np.full(1 << 20, i + 1, dtype=np.uint8)) for i in range(n)])
print("done", flush=True)
"""


@pytest.mark.parametrize("route", ["xorb_upload", "batch"])
def test_hf_bucket_writer_killed_before_or_during_its_commit(hub_bucket: Any, hub_faults: Any,
                                                             route: str) -> None:
    """SIGKILL while the Xet upload runs (nothing committed) or while the bucket's batch commit is
    in flight: afterwards every name is absent or a complete chunk that verifies."""
    from kvbucket.stores.guard.sealed import seal_store
    from kvbucket.stores.hub.config import build_config
    from kvbucket.stores.hub.store import HFBucketStore

    hub = hub_bucket.hub
    hub_faults.add(route, latency_s=3.0)  # hold the step, so the kill surely lands inside it
    n = 8
    proc = _spawn(HF_WRITER, hub.endpoint, hub.write_token, hub_bucket.bucket_id, str(n))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(r["seen"] for r in hub_faults.rules()):
        time.sleep(0.01)
    assert any(r["seen"] for r in hub_faults.rules()), f"the writer never reached {route}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    time.sleep(3.5)  # let the held request finish on the server, whatever it does with it
    hub_faults.reset()
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}", token=hub.write_token,
                       token_env="", endpoint=hub.endpoint)
    store = seal_store(HFBucketStore(cfg), tier="remote")
    try:
        listed = {o.name for o in store.list("")}
        if route == "xorb_upload":
            assert not listed  # no commit was sent: nothing is visible
        bufs = [bytearray(1 << 20) for _ in range(n)]
        for i, r in enumerate(store.get_many([f"c{i}" for i in range(n)], bufs)):
            assert r.ok
            if r.found:  # committed whole: the complete chunk, verified
                assert r.name in listed and bytes(bufs[i]) == bytes([i + 1]) * (1 << 20)
            else:
                assert r.name not in listed
    finally:
        store.close()
