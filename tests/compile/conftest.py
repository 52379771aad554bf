"""Fixtures of the compile-cache tests: one store per backend, a stand-in compiler per "host"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.stores.base import ObjectStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.counting_store import CountingStore
from kvbucket.testing.neuron_standin import DEFAULT_VERSION as VERSION
from kvbucket.testing.neuron_standin import StandInCompiler


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if kind == "memory":
        return MemoryStore("compile")
    if kind == "file":
        return FileStore(tmp_path / "bucket")
    if kind == "s3":
        from kvbucket.stores.s3.store import S3Config, S3Store

        server = request.getfixturevalue("seaweedfs")
        bucket = request.getfixturevalue("s3_bucket")
        return S3Store(S3Config.parse(server.config(bucket, "compile-cache")))
    if kind == "hf":
        from kvbucket.stores.hub.open import open_hfbucket_store

        bucket = request.getfixturevalue("hub_bucket")
        return open_hfbucket_store(f"hf://buckets/{bucket.bucket_id}/compile-cache",
                                   endpoint=bucket.hub.endpoint, token=bucket.hub.write_token, token_env="")
    raise AssertionError(kind)


@pytest.fixture(params=["memory", "file", "s3", "hf"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingStore]:
    """The same compile-cache tests run on every store kvbucket offers.

    S3 is a real SeaweedFS; hf is the project's Hub emulator driven by the unmodified
    huggingface_hub/hf_xet through HFBucketStore.
    """
    s = CountingStore(_open(request.param, request, tmp_path))
    yield s
    s.close()


@pytest.fixture(params=["memory", "file"])
def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingStore]:
    """For tests about request counts, which do not depend on the backend."""
    s = CountingStore(_open(request.param, request, tmp_path))
    yield s
    s.close()


@pytest.fixture
def host_a(tmp_path: Path) -> StandInCompiler:
    return StandInCompiler(tmp_path / "host-a", VERSION)


@pytest.fixture
def host_b(tmp_path: Path) -> StandInCompiler:
    return StandInCompiler(tmp_path / "host-b", VERSION)
