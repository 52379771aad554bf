"""The object-store conformance suite run over the stores that live in this repository."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.stores import MemoryStore, open_store
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.store_tests import StoreTests


class TestMemoryStore(StoreTests):
    supports_reopen = False  # each MemoryStore is its own dict
    lists_sorted = True

    @pytest.fixture
    def store(self) -> Iterator[MemoryStore]:
        with MemoryStore("conformance") as s:
            yield s


class TestFileStore(StoreTests):
    supports_reopen = True
    checks_served_bytes = True  # a persistent store the KV tiers load from
    lists_sorted = True
    name_and_prefix_coexist = False  # a directory tree cannot hold both "a" and "a/x"

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[FileStore]:
        with FileStore(tmp_path / "store") as s:
            yield s

    def reopen(self, store: FileStore) -> FileStore:
        return FileStore(store.root, create=False)


class TestFileStoreFsyncViaURL(StoreTests):
    """The same suite through ``open_store`` with fsync on: the durable configuration."""

    supports_reopen = True
    lists_sorted = True
    name_and_prefix_coexist = False  # a directory tree cannot hold both "a" and "a/x"

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[FileStore]:
        s = open_store(f"file://{tmp_path}/durable", fsync=True)
        assert isinstance(s, FileStore) and s.fsync
        with s:
            yield s

    def reopen(self, store: FileStore) -> FileStore:
        s = open_store(store.url)
        assert isinstance(s, FileStore)
        return s
