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

HUB_RECHECK_DELAY = 2.5


@pytest.fixture(params=["file", "s3", "hub"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], ObjectStore]]:
    """A factory of fresh stores over one shared place (each node opens its own)."""
    if request.param == "file":
        yield lambda: FileStore(tmp_path / "shared")
    elif request.param == "s3":
        seaweedfs, bucket = request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket")
        yield lambda: S3Store(S3Config.parse(seaweedfs.config(bucket)))
    else:
        # recheck_delay_secs 2.5, not 5 (as test_integrity_hub_rechecks.py; the delete window stays
        # at its default 2): a fleet on the Hub evicts no chunk younger than twice it, and a writer's
        # re-check (settle_writes) waits for it, so the tests waited 5 s more and checked the same
        hub_bucket = request.getfixturevalue("hub_bucket")
        yield lambda: HFBucketStore(HFBucketConfig(
            bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv", token=hub_bucket.hub.write_token,
            endpoint=hub_bucket.hub.endpoint, metadata_cache_ttl_secs=0,
            recheck_delay_secs=HUB_RECHECK_DELAY))
