"""The SeaweedFS fixture leaves nothing behind: no process, no temp dir, no sockets in /tmp."""

from __future__ import annotations

import os
from pathlib import Path

from kvbucket.testing.s3_server import SeaweedFS


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
    finally:
        weed.stop()
    assert not Path(root).exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    leftovers = [p for port in ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
    assert leftovers == []
    weed.stop()  # idempotent
