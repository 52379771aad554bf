"""The smallest correct StorageBackend, for unit tests of logic that sits above the tiers.

Real tiers are tested through BackendTests; this one exists so tests of callers (prefix reuse,
metrics wrappers) can count calls or inject failures without a real tier's side effects.
"""

from __future__ import annotations

from kvbucket.backends.base import Chunk, Key, StorageBackend


class DictBackend(StorageBackend):
    """Chunks in a dict keyed by key string; ``gets`` counts ``get`` calls."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.gets = 0

    def put(self, key: Key, chunk: Chunk, blocking: bool = True) -> None:
        self.data[str(key)] = bytes(memoryview(chunk).cast("B"))

    def get(self, key: Key) -> Chunk | None:
        self.gets += 1
        return self.data.get(str(key))

    def contains(self, key: Key) -> bool:
        return str(key) in self.data

    def remove(self, key: Key) -> bool:
        return self.data.pop(str(key), None) is not None

    def list(self) -> list[str]:
        return list(self.data)
