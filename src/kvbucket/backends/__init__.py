"""Storage backends (seed 002): chunk tiers keyed by cache keys, stacked by HybridBackend.

``kvbucket.backends.build.build_backend(config, layout)`` (also ``kvbucket.config.build_backend``)
builds the stack an engine config describes.
"""

from __future__ import annotations

from kvbucket.backends.base import Chunk, FlushResult, Key, StorageBackend
from kvbucket.backends.hybrid import HybridBackend, TierPutError
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend

__all__ = [
    "Chunk",
    "FlushResult",
    "HybridBackend",
    "Key",
    "LocalCPUBackend",
    "LocalDiskBackend",
    "PipelinedRemoteBackend",
    "RemoteBackend",
    "StorageBackend",
    "TierPutError",
]
