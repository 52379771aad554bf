"""Shared fixtures. Servers used by tests are started by fixtures on 127.0.0.1 and stopped at the end.

Server fixtures live in ``kvbucket.testing`` modules (users can load them too) and are enabled
here, one line each.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

pytest_plugins: list[str] = [
    "kvbucket.testing.capabilities",
    "kvbucket.testing.hub_fixtures",
    "kvbucket.testing.s3_server",
]


@pytest.fixture
def lm_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread, as LMCache's engine gives its non-MP remote connectors."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
    loop.close()


@pytest.fixture(autouse=True, scope="session")
def _identity_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Weight digests (kvbucket.identity.local_cache) go to a file of this run, never ~/.cache.
    Set in os.environ so subprocesses (the CLI, engines) inherit it."""
    import os

    old = os.environ.get("KVBUCKET_IDENTITY_CACHE")
    os.environ["KVBUCKET_IDENTITY_CACHE"] = str(tmp_path_factory.mktemp("identity") / "weights.json")
    yield
    if old is None:
        os.environ.pop("KVBUCKET_IDENTITY_CACHE", None)
    else:
        os.environ["KVBUCKET_IDENTITY_CACHE"] = old
