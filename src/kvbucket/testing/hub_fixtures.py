"""Pytest fixtures around ``HubEmulator``; enable with ``pytest_plugins = ["kvbucket.testing.hub_fixtures"]``.

- ``hub_emulator`` (session): a running emulator with its own data dir, a write token and a read
  token. It gives the process a private ``HF_XET_CACHE`` (hf_xet's shard cache never meets a
  server whose state it does not match) and hides any stored Hugging Face token (see
  ``isolate_hf_env``).
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


_CONSTANTS = (
    "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH", "HF_XET_CACHE",
    "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS",
)  # fmt: skip


_ENV_VARS = ("HF_XET_CACHE", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_TOKEN")
_CONSTANTS = (
    "HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH", "HF_XET_CACHE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)  # fmt: skip


def isolate_hf_env(home: Path) -> dict[str, Any]:
    """Give this process a private Xet cache and no stored token; returns what ``restore_env`` needs.

    - ``HF_XET_CACHE``: hf_xet dedups uploads against the shards it cached; a cache that
      remembers xorbs this emulator never saw makes uploads fail ("references unknown xorb").
      hf_xet reads the variable when its session is first created in the process.
    - Token: huggingface_hub reads its token path at import into ``huggingface_hub.constants``
      (test modules import it before fixtures run), so the constants are patched too, and
      ``HF_TOKEN`` is unset: a client made with ``token=None`` never sends a real token here.
    - ``HF_HOME`` and the model cache are left alone: other tests in the same session may rely
      on models cached there.
    """
    saved: dict[str, Any] = {"env": {k: os.environ.get(k) for k in _ENV_VARS}}
    os.environ["HF_XET_CACHE"] = str(home / "xet")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.pop("HF_TOKEN", None)
    from huggingface_hub import constants

    saved["constants"] = {k: getattr(constants, k) for k in _CONSTANTS}
    new = {
        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_XET_CACHE": str(home / "xet"), "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
    }  # fmt: skip
    for k, v in new.items():
        setattr(constants, k, v)
    return saved


def restore_env(saved: dict[str, Any]) -> None:
    for k, v in saved["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    from huggingface_hub import constants

    for k, v in saved["constants"].items():
        setattr(constants, k, v)


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
