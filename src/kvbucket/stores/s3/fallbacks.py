"""obstore calls of ``S3Store`` on its pool: whole-object fallbacks (an item its direct read did not
settle, repeated through obstore) held to the store's transfer budget, and submissions that meet
a pool shut down by a concurrent close().

Why: ``s3_num_io_threads`` bounds a store's requests in flight, and direct reads take a slot of
it (:class:`~kvbucket.stores.s3.transfers.Slots`) per transfer; obstore's calls ran on the pool
without one, so a load's fallbacks came on top of other loads' direct reads (measured through a
FaultProxy, budget 4: 6 requests at the server; tests/s3/test_s3_ranged_leftovers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult
from kvbucket.stores.deadline import left
from kvbucket.stores.s3.transfers import Slots
from kvbucket.threads import submit_current


def within_budget(fn: Callable[..., ItemResult], slots: Slots, deadline: float,
                  late: Callable[[], StoreError],
                  closed: Callable[[], StoreError]) -> Callable[..., ItemResult]:
    """``fn`` (one obstore call for one item) run once a slot of ``slots`` is held, released when
    it returns; an item that gets none by ``deadline`` fails with ``late()``, and with ``closed()``
    once the store is closed (nothing sent for it)."""

    def run(name: str, *rest: Any, **kw: Any) -> ItemResult:
        if not slots.acquire(timeout=left(deadline)):
            return ItemResult(name, error=closed() if slots.closed else late())
        try:
            return fn(name, *rest, **kw)
        finally:
            slots.release()

    return run


def submit_all(pool: Callable[[], Executor], fn: Callable[..., ItemResult], args: Sequence[tuple[Any, ...]],
               extra: Sequence[tuple[Any, ...]], closed: Callable[[], bool],
               kw: dict[str, Any]) -> list[Future[ItemResult] | None]:
    """``fn(*args[i], *extra[i], **kw)`` submitted to the store's current pool (``pool()``: one
    handed over by a concurrent call's deadline is followed to its successor) for each item; None
    for the items left when the pool refuses work because the store was closed meanwhile
    (``closed()``: close() shuts the pool down, and a load between its direct reads and their
    fallbacks raised "cannot schedule new futures after shutdown"). Another refusal is raised."""
    futures: list[Future[ItemResult] | None] = []
    for a, e in zip(args, extra, strict=True):
        try:
            futures.append(submit_current(pool, closed, fn, *a, *e, **kw))
        except RuntimeError:
            if not closed():
                raise
            futures.extend([None] * (len(args) - len(futures)))
            break
    return futures


__all__ = ["submit_all", "within_budget"]
