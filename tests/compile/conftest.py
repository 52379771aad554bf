"""Fixtures of the compile-cache tests: a store per backend, cache dirs per "host"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.stores.base import ObjectStore
from kvbucket.stores.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler


@pytest.fixture(params=["memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingStore]:
    """The same compile-cache tests run on every store kvbucket offers."""
    inner: ObjectStore = MemoryStore("compile")
    s = CountingStore(inner)
    yield s
    s.close()


@pytest.fixture
def host_a(tmp_path: Path) -> StandInCompiler:
    return StandInCompiler(tmp_path / "host-a", VERSION)


@pytest.fixture
def host_b(tmp_path: Path) -> StandInCompiler:
    return StandInCompiler(tmp_path / "host-b", VERSION)
