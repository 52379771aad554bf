"""Fixtures of the CLI tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """A private config dir and no cloud credentials or endpoints from the developer's shell."""
    env = {"KVBUCKET_CONFIG_DIR": str(tmp_path / "kvbucket-config"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("HF_TOKEN", "HF_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                 "AWS_SESSION_TOKEN", "AWS_PROFILE", "KVBUCKET_COMPILE_CACHE", "KVBUCKET_LOG_LEVEL"):
        env[name] = ""
    return env


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()
