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
