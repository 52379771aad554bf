"""The SeaweedFS fixture leaves nothing behind (no process, temp dir or sockets in /tmp) and holds
as many buckets on a nearly full disk as on an empty one."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from kvbucket.testing.s3_server import VOLUME_MAX, SeaweedFS


def test_seaweedfs_starts_serves_and_cleans_up() -> None:
    weed = SeaweedFS()
    server = weed.start()
    assert weed.proc is not None and weed.dir is not None
    pid, root, ports = weed.proc.pid, weed.dir, list(weed._ports.values())
    try:
        bucket = server.create_bucket()
        server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
        assert oct(os.stat(f"{root}/data").st_mode & 0o777) == "0o700"
        # Buckets it can hold at once do not depend on the disk's free space (weed's default).
        status_url = f"http://127.0.0.1:{weed._ports['master.port']}/dir/status"
        with urllib.request.urlopen(status_url, timeout=10) as r:
            assert json.load(r)["Topology"]["Max"] == VOLUME_MAX
    finally:
        weed.stop()
    assert not Path(root).exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    leftovers = [p for port in ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
    assert leftovers == []
    weed.stop()  # idempotent
