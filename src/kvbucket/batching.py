"""Cutting a stream of items into store batches bounded by count and bytes.

Every batch verb of a store takes many objects at once; callers that move many objects (compile
cache sync/fetch, ``kvbucket verify``, ``kvbucket migrate``) cut their work with this one helper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def batches(items: Iterable[T], size_of: Callable[[T], int], max_items: int,
            max_bytes: int) -> Iterator[list[T]]:
    """Split into batches of at most ``max_items`` items and (unless one item is larger) ``max_bytes``."""
    batch: list[T] = []
    nbytes = 0
    for it in items:
        n = size_of(it)
        if batch and (len(batch) >= max_items or nbytes + n > max_bytes):
            yield batch
            batch, nbytes = [], 0
        batch.append(it)
        nbytes += n
    if batch:
        yield batch


__all__ = ["batches"]
