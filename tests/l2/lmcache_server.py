"""The real ``lmcache server`` in a subprocess, for the tests that drive it (tests only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvbucket.testing.lmcache_mp import BLOCK
from kvbucket.testing.s3_server import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")
PLUGIN = {"type": "plugin", "module_path": "kvbucket.integrations.lmcache", "class_name": "KVBucketL2Adapter"}


class Server:
    """``lmcache server`` in a subprocess of its own session (killed with its group)."""

    def __init__(self, adapters: list[dict[str, Any]], log: Path, *, argv: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``adapters``: kvbucket plugin ``adapter_params``, one ``--l2-adapter`` each, with a small
        L1; or ``argv``: the arguments after ``lmcache server`` as a user wrote them (a doc's
        command). Either way the harness adds its free ports, chunk size and transfer mode."""
        self.http, self.port = free_port(), free_port()
        while self.port == self.http:  # a port just released can be handed out again at once
            self.port = free_port()
        args = [sys.executable, "-m", "lmcache.cli.main", "server"]
        if argv is None:
            args += ["--l1-size-gb", "0.05", "--eviction-policy", "LRU"]
            for params in adapters:
                args += ["--l2-adapter", json.dumps({**PLUGIN, "adapter_params": params})]
        else:
            args += argv
        # engine_driven: the MP client moves CPU KV caches itself (lmcache_driven is CUDA/NPU IPC)
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                 "--http-port", str(self.http), "--chunk-size", str(BLOCK),
                 "--supported-transfer-mode", "engine_driven"]  # fmt: skip
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        self.log = log
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.http}"

    def wait_ready(self, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"lmcache server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthcheck", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"lmcache server not ready: {self.log.read_text()[-3000:]}")

    def adapters(self, complete: bool = True, timeout: float = 60) -> list[dict[str, Any]]:
        """The L2 adapters' report_status() as the server shows them (after the startup listings)."""
        deadline = time.monotonic() + timeout
        while True:
            found = httpx.get(self.url + "/status", timeout=10).json()["storage_manager"]["l2_adapters"]
            if not complete or all(a.get("usage_complete") for a in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def l1_objects(self) -> int:
        status = httpx.get(self.url + "/status", timeout=10).json()["storage_manager"]
        return status["l1_manager"]["total_object_count"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
