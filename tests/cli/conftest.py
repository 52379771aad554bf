"""Fixtures of the CLI tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_run import clean_env

from kvbucket.testing.silent_server import SilentServer


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """A private config dir and no cloud credentials or endpoints from the developer's shell."""
    return clean_env(tmp_path / "kvbucket-config")


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers a byte (kvbucket.testing.silent_server:
    its close() wakes the accept at once, where a loop of 0.2 s accept timeouts made each test's
    teardown wait up to 0.2 s)."""
    with SilentServer() as srv:
        yield srv.port
