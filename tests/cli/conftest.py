"""Fixtures of the CLI tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.testing.silent_server import SilentServer


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
    """A port that accepts connections and never answers a byte (kvbucket.testing.silent_server:
    its close() wakes the accept at once, where a loop of 0.2 s accept timeouts made each test's
    teardown wait up to 0.2 s)."""
    with SilentServer() as srv:
        yield srv.port
