"""Fixtures of the integrity tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvbucket.stores.base import ObjectStore
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store


@pytest.fixture(params=["file", "s3", "hub"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], ObjectStore]]:
    """A factory of fresh stores over one shared place (each node opens its own)."""
    if request.param == "file":
        yield lambda: FileStore(tmp_path / "shared")
    elif request.param == "s3":
        seaweedfs, bucket = request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket")
        yield lambda: S3Store(S3Config.parse(seaweedfs.config(bucket)))
    else:
        hub_bucket = request.getfixturevalue("hub_bucket")
        yield lambda: HFBucketStore(HFBucketConfig(
            bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv", token=hub_bucket.hub.write_token,
            endpoint=hub_bucket.hub.endpoint, metadata_cache_ttl_secs=0))
