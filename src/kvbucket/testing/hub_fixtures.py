"""Pytest fixtures around ``HubEmulator``; enable with ``pytest_plugins = ["kvbucket.testing.hub_fixtures"]``.

- ``hub_emulator`` (session): a running emulator with its own data dir, a write token and a read
  token. Before any client is used it points ``HF_HOME`` / ``HF_XET_CACHE`` at a private temp dir,
  so hf_xet's shard cache never meets a server whose state it does not match, and so no real
  Hugging Face token from the developer's machine is ever sent to it.
- ``hub_bucket`` (function): a fresh private bucket with a unique name; faults are reset before
  and after the test.
- ``hub_faults`` (function): the fault control, reset before and after the test.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .hub_emulator import FaultControl, HubEmulator

WRITE_USER = "kvtest"
READ_USER = "kvreader"
_ENV_VARS = (
    "HF_HOME", "HF_XET_CACHE", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_TOKEN",
)  # fmt: skip


@dataclass
class RunningHub:
    """What the ``hub_emulator`` fixture yields."""

    emulator: HubEmulator
    write_token: str
    read_token: str
    namespace: str = WRITE_USER

    @property
    def endpoint(self) -> str:
        return self.emulator.endpoint

    @property
    def data_dir(self) -> Path:
        return self.emulator.data_dir

    @property
    def faults(self) -> FaultControl:
        return self.emulator.faults

    def stats(self) -> dict[str, Any]:
        return self.emulator.stats()

    def api(self, token: str | bool | None = None) -> Any:
        """An ``HfApi`` on this emulator (write token unless told otherwise; ``False`` = anonymous)."""
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.write_token if token is None else token)

    def __repr__(self) -> str:  # keep tokens out of pytest's failure output
        return f"RunningHub(endpoint={self.endpoint!r}, data_dir={str(self.data_dir)!r})"


@dataclass
class HubBucket:
    """What the ``hub_bucket`` fixture yields: a fresh private bucket."""

    hub: RunningHub
    bucket_id: str

    @property
    def api(self) -> Any:
        return self.hub.api()


def isolate_hf_env(home: Path) -> dict[str, str | None]:
    """Point huggingface_hub/hf_xet at a private HF_HOME; returns the previous values to restore."""
    saved = {k: os.environ.get(k) for k in _ENV_VARS}
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_XET_CACHE"] = str(home / "xet")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.pop("HF_TOKEN", None)
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def hub_emulator() -> Iterator[RunningHub]:
    home = Path(tempfile.mkdtemp(prefix="kvbucket-hfhome-"))
    saved = isolate_hf_env(home)
    write_token, read_token = "hf_w" + secrets.token_hex(12), "hf_r" + secrets.token_hex(12)
    tokens = {WRITE_USER: (write_token, "write"), READ_USER: (read_token, "read")}
    try:
        with HubEmulator(tokens=tokens) as emu:
            yield RunningHub(emu, write_token, read_token)
    finally:
        restore_env(saved)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def hub_faults(hub_emulator: RunningHub) -> Iterator[FaultControl]:
    faults = hub_emulator.faults
    faults.reset()
    yield faults
    faults.reset()


@pytest.fixture
def hub_bucket(hub_emulator: RunningHub) -> Iterator[HubBucket]:
    hub_emulator.faults.reset()
    bucket_id = f"{hub_emulator.namespace}/t-{uuid.uuid4().hex[:16]}"
    hub_emulator.api().create_bucket(bucket_id, private=True)
    yield HubBucket(hub_emulator, bucket_id)
    hub_emulator.faults.reset()
