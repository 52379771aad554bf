"""The backend conformance suite over every backend in this repository, on real files where
the backend persists (FileStore in a temp dir)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.backend_tests import BackendTests

BIG = 64 * 1024 * 1024


class TestLocalCPUBackend(BackendTests):
    bounded = True

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        with LocalCPUBackend(BIG) as b:
            yield b

    def make_bounded(self, capacity_bytes: int, request: pytest.FixtureRequest) -> StorageBackend:
        return LocalCPUBackend(capacity_bytes)


class TestLocalDiskBackend(BackendTests):
    bounded = True
    supports_reopen = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        with LocalDiskBackend(tmp_path / "disk", BIG) as b:
            yield b

    def make_bounded(self, capacity_bytes: int, request: pytest.FixtureRequest) -> StorageBackend:
        return LocalDiskBackend(request.getfixturevalue("tmp_path") / "bounded", capacity_bytes)

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, LocalDiskBackend) and isinstance(backend.store.inner, FileStore)
        return LocalDiskBackend(backend.store.inner.root, BIG)


class TestRemoteBackendOverMemoryStore(BackendTests):
    refuses_unfull_chunks = True

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        with RemoteBackend(MemoryStore("remote"), self.layout) as b:
            yield b


class TestRemoteBackendOverFileStore(BackendTests):
    refuses_unfull_chunks = True
    supports_reopen = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        with RemoteBackend(FileStore(tmp_path / "remote"), self.layout, prefix="kv/llama") as b:
            yield b

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, RemoteBackend) and isinstance(backend.store.inner, FileStore)
        return RemoteBackend(FileStore(backend.store.inner.root), self.layout, prefix="kv/llama")


class TestRemoteBackendKeepingUnfullChunks(BackendTests):
    refuses_unfull_chunks = False

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        with RemoteBackend(MemoryStore("remote"), self.layout, save_unfull_chunk=True) as b:
            yield b


class TestPipelinedRemoteBackend(BackendTests):
    refuses_unfull_chunks = True
    supports_reopen = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        with PipelinedRemoteBackend(FileStore(tmp_path / "remote"), self.layout, pipeline_batch=2,
                                    max_inflight=2) as b:
            yield b

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, RemoteBackend) and isinstance(backend.store.inner, FileStore)
        return PipelinedRemoteBackend(FileStore(backend.store.inner.root), self.layout, pipeline_batch=2)


class TestHybridBackend(BackendTests):
    """local_cpu -> local_disk -> remote, as build_backend makes it."""

    refuses_unfull_chunks = True  # the remote tier refuses them, so the put is reported failed
    supports_reopen = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        with self._stack(tmp_path) as b:
            yield b

    def _stack(self, root: Path) -> HybridBackend:
        return HybridBackend([
            LocalCPUBackend(BIG),
            LocalDiskBackend(root / "disk", BIG),
            RemoteBackend(FileStore(root / "remote"), self.layout),
        ])

    def reopen(self, backend: StorageBackend) -> StorageBackend:
        assert isinstance(backend, HybridBackend)
        disk = backend.tiers[1]
        assert isinstance(disk, LocalDiskBackend) and isinstance(disk.store.inner, FileStore)
        return self._stack(disk.store.root.parent)


class TestHybridCPUOverRemote(BackendTests):
    refuses_unfull_chunks = True

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        with HybridBackend([LocalCPUBackend(BIG), PipelinedRemoteBackend(MemoryStore(), self.layout)]) as b:
            yield b


class TestHybridSequentialWrites(BackendTests):
    """The same stack writing its tiers one after the other (parallel_writes=False)."""

    refuses_unfull_chunks = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        with HybridBackend([LocalCPUBackend(BIG), LocalDiskBackend(tmp_path / "disk", BIG),
                            RemoteBackend(MemoryStore(), self.layout)], parallel_writes=False) as b:
            yield b
