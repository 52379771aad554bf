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


def _slow_seconds(item: pytest.Item) -> float | None:
    """A test's ``@pytest.mark.slow(SECONDS)`` (its quiet-machine time; 30 when not said), or None."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return None
    return float(mark.args[0]) if mark.args else 30.0


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the shares are of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests (``@pytest.mark.slow``) start first, spread over the workers.

    pytest-xdist's ``worksteal`` hands each of its N workers one contiguous share of the collection
    (the first ``len // N`` tests, then ...) and idle workers later steal from the END of a busy
    one's queue. Left in collection order, a 100-s engine test can start last and be the run's
    tail, or both engine tests can sit in one worker's share. Here each share starts with its
    long tests, longest first, balanced by their seconds; every other test keeps its order.
    """
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    slow = sorted((it for it in items if _slow_seconds(it) is not None),
                  key=lambda it: -(_slow_seconds(it) or 0))
    if not slow:
        return
    ids = {id(it) for it in slow}
    rest = [it for it in items if id(it) not in ids]
    sizes, left = [], len(items)
    for i in range(workers):  # as worksteal's first schedule: len(pending) // nodes_remaining
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for it in slow:  # the longest first, to the share with the least slow time (greedy LPT)
        i = min(range(workers), key=lambda j: (load[j], j))
        shares[i].append(it)
        load[i] += _slow_seconds(it) or 0
    for i in range(workers):
        need = max(0, sizes[i] - len(shares[i])) if i < workers - 1 else len(rest)
        shares[i] += rest[:need]
        rest = rest[need:]
    items[:] = [it for share in shares for it in share]


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
