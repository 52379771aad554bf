"""Benchmark helper: tiers without the chunk envelope, to measure what sealing costs.

:class:`Unsealed` passes every verb straight to the raw store (no header, no checksum, no
verification): the tiers as they were before sealing. It exists only so the benchmarks can print
"verification on vs off" ratios measured in the same run; kvbucket itself has no such switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.sealed import SealedStore


class Unsealed(SealedStore):
    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner, tier="bench-unsealed")
        self.overhead = 0

    def put_many(self, items: Sequence[tuple[str, Any]]) -> Any:
        return self.inner.put_many(items)

    def get_many(self, names: Sequence[str], out: Sequence[Any] | None = None) -> Any:
        return self.inner.get_many(names, out)

    def head_many(self, names: Sequence[str]) -> Any:
        return self.inner.head_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Any:
        return self.inner.list(prefix, page_size=page_size)

    def check_headers(self, infos: Sequence[Any]) -> list[str | None]:
        return [None] * len(infos)


@contextlib.contextmanager
def unsealed_l2_adapters() -> Iterator[None]:
    """L2 adapters created inside this block store raw bytes (their stores are :class:`Unsealed`).

    Raises when no adapter store was wrapped: if the adapter stopped sealing through
    ``kvbucket.l2.adapter.seal_store``, an "unsealed" row would silently measure sealed stores.
    """
    import kvbucket.l2.adapter as adapter_mod

    made: list[Unsealed] = []

    def unsealed(store: ObjectStore, **_: Any) -> Unsealed:
        made.append(Unsealed(store))
        return made[-1]

    original = adapter_mod.seal_store
    adapter_mod.seal_store = unsealed  # type: ignore[assignment]
    try:
        yield
    finally:
        adapter_mod.seal_store = original
    if not made:
        raise RuntimeError("no L2 adapter store was left unsealed: the adapter no longer seals through "
                           "kvbucket.l2.adapter.seal_store; update benchmarks/unsealed.py")
