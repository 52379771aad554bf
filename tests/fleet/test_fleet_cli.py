"""``kvbucket du`` on a prefix a fleet uses: the installed console script, in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvbucket.fleet.config import FleetConfig
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.stores.local.file import FileStore
from kvbucket.testing import l2 as t
from kvbucket.testing.fleet_node import chunk, key

FAST = {"sync_secs": 0.1, "heartbeat_secs": 0.5, "node_timeout_secs": 30.0, "compact_secs": 0.3}


def kvbucket_cli() -> str:
    return shutil.which("kvbucket", path=os.path.dirname(sys.executable)) or "kvbucket"


def test_du_shows_fleet_usage_salt_shares_and_nodes(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = FileStore(root)
    nodes = [ObjectStoreL2Adapter(store, owns_store=False, full_chunk_bytes=1000,
                                  fleet=FleetConfig(node_id=n, **FAST)) for n in ("node-a", "node-b")]
    try:
        assert all(a.wait_until_rebuilt(10) for a in nodes)
        keys = [key(i, "tenant-a") for i in range(3)]
        assert t.store(nodes[0], keys, [chunk(i, 1000) for i in range(3)]).success
        assert t.store(nodes[1], [key(9, "tenant-b")], [chunk(9, 1000)]).success
    finally:
        for a in nodes:
            a.close()  # publishes the last journal
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([kvbucket_cli(), "du", str(root)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("fleet index: 4 chunks, 4000 bytes")
    assert "  salt 'tenant-a': 3000 bytes (2.9 KiB, 75.0%)" in lines
    assert "  salt 'tenant-b': 1000 bytes (1000 B, 25.0%)" in lines
    assert any(ln.startswith("  node node-a: last seen") for ln in lines)
    assert any(ln.startswith("  node node-b: last seen") for ln in lines)
    store.close()
    # A prefix no fleet used prints no fleet lines.
    plain = tmp_path / "plain"
    FileStore(plain).put("x", b"1")
    proc = subprocess.run([kvbucket_cli(), "du", str(plain)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
