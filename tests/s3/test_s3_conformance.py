"""The object-store conformance suite over S3Store on SeaweedFS (signatures checked) and on moto."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbucket.stores import open_store
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import S3Server
from kvbucket.testing.store_tests import StoreTests


class TestS3StoreOnSeaweedFS(StoreTests):
    supports_reopen = True
    checks_served_bytes = True  # a persistent store the KV tiers load from
    lists_sorted = False  # SeaweedFS lists its directory tree ("a/b" before "a%2F"), not byte order

    @pytest.fixture
    def store(self, seaweedfs: S3Server, s3_module_bucket: str, fresh_prefix: str) -> Iterator[S3Store]:
        # a fresh prefix in the module's bucket, not a bucket per test (s3_module_bucket)
        cfg = seaweedfs.config(s3_module_bucket, f"conformance/{fresh_prefix}")
        with S3Store.from_config(S3Config.parse(cfg)) as s:
            yield s

    def reopen(self, store: S3Store) -> S3Store:
        return S3Store(store.config)


class TestS3StoreObstoreReadsOnSeaweedFS(TestS3StoreOnSeaweedFS):
    """The same suite with every GET through obstore: the path of proxies, h2, S3 Express and of
    every direct read that fails over (the default runs GETs through s3_direct)."""

    @pytest.fixture
    def store(self, seaweedfs: S3Server, s3_module_bucket: str, fresh_prefix: str) -> Iterator[S3Store]:
        cfg = seaweedfs.config(s3_module_bucket, f"conformance/{fresh_prefix}", s3_direct_reads=False)
        with S3Store.from_config(S3Config.parse(cfg)) as s:
            assert s._direct is None
            yield s


class TestS3StoreOnMoto(StoreTests):
    supports_reopen = True
    lists_sorted = True  # moto, like AWS, lists in UTF-8 byte order

    @pytest.fixture
    def store(
        self, moto_s3: S3Server, moto_bucket: str, monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[S3Store]:
        for k, v in moto_s3.env().items():  # through open_store and the standard env vars
            monkeypatch.setenv(k, v)
        s = open_store(f"s3://{moto_bucket}/conf")
        assert isinstance(s, S3Store)
        with s:
            yield s

    def reopen(self, store: S3Store) -> S3Store:
        return S3Store(store.config)
