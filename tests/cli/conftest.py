"""Fixtures of the CLI tests."""

from __future__ import annotations

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
