"""A Hub load's fetches, and the loads in flight on a store, so that ``close()`` ends them at once.

Why: a load waits for its fetches on the store's load pool until ``load_timeout_secs``, and
hf_xet's streams and the Xet reader's sockets cannot be cancelled. A store closed while threads
load from it made each of them wait out that budget (5 s by default, 30 s where raised) and then
say the load timed out. Here each load registers its gates; ``close()`` closes every gate (a
write in progress finishes first, no later one touches the caller's buffer: the
:class:`~kvbucket.stores.deadline.Gate` invariant) and wakes its caller, which returns the
items not read whole with the error S3 gives (:func:`~kvbucket.stores.base.closed_during`).
No lock is taken per chunk: only once per load, to register and to unregister.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kvbucket.stores.base import Buffer, ItemResult, closed_during
from kvbucket.stores.deadline import Gate, exceeded, left
from kvbucket.stores.hub.client import RemoteFile

# ``store`` below is an HFBucketStore (not imported: the store imports this module).
HFBucketStore = Any
Job = tuple[int, RemoteFile, memoryview, Buffer]  # (item index, file, whole-object view, buffer returned)


class Load:
    """One ``get_many`` in flight: its gates, and the event its caller waits on."""

    __slots__ = ("_done", "_lock", "_todo", "ended", "gates")

    def __init__(self, gates: Sequence[Gate]) -> None:
        self.gates = gates
        self.ended = False  # close() ended it
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._todo = 0

    def wait(self, futures: Sequence[Future[Any]], until: float) -> bool:
        """Wait until every future is done, ``until`` passes or close() ends the load; True when
        every future is done."""
        with self._lock:
            self._todo = len(futures)
        for f in futures:
            f.add_done_callback(self._one)  # run at once for a future already done
        self._done.wait(left(until))
        return all(f.done() for f in futures)

    def _one(self, _f: Future[Any]) -> None:
        with self._lock:
            self._todo -= 1
            last = self._todo <= 0
        if last:
            self._done.set()

    def end(self) -> None:
        """Close every gate (after a write in progress), then wake the caller."""
        self.ended = True
        for g in self.gates:
            g.close()
        self._done.set()


class Loads:
    """The loads in flight on one store; :meth:`close` ends them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Load] = set()
        self._closed = False

    def start(self, gates: Sequence[Gate]) -> Load:
        """Register a load; one started after close() is ended at once (nothing is fetched)."""
        load = Load(gates)
        with self._lock:
            if not self._closed:
                self._live.add(load)
                return load
        load.end()
        return load

    def finish(self, load: Load) -> None:
        with self._lock:
            self._live.discard(load)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
        for load in live:
            load.end()


def settled(results: list[ItemResult], load: Load, url: str, gates: Sequence[Gate]) -> list[ItemResult]:
    """``results`` of a load, each with its item's gate. An item failed has its gate closed here.
    In a load close() ended, an item read whole (or missing) stays as it is; every other item
    failed because of the close, whatever its error says (a closed gate, a shut connection, a
    cancelled fetch), so it says that.

    **Invariant (a failed item's buffer is the caller's again when the load returns).** Every
    item returned failed has its gate closed first: a write in progress ends, no later one lands.
    An object read in parts fails at its deadline with parts still running on request threads
    (xet.reads ``_fetch_all``); its fetch job returned in time, so the load's ``late`` path,
    which closes the gates of jobs not done, did not see it, and those parts wrote into a
    buffer the caller had already reused (an outside tester: 4 of 9 reused buffers overwritten,
    up to 3.9 MiB, 32 MiB objects at a 0.3 s deadline)."""
    for r, gate in zip(results, gates, strict=True):
        if r.error is not None:
            gate.close()
    if not load.ended:
        return results
    err = closed_during(url)
    return [r if r.error is None else ItemResult(r.name, error=err) for r in results]


def fetch_jobs(store: HFBucketStore, names: list[str], out: Sequence[Buffer | None] | None, jobs: list[Job],
               gates: list[Gate], load: Load, deadline: float
               ) -> list[tuple[list[int], list[ItemResult]]] | None:
    """Read every job into its view, runs of neighbours with one fetch; each group of job indexes
    with its results (None: the store was closed before a fetch was sent)."""
    client = store._client
    client.prefetch_reconstructions([j[1] for j in jobs], deadline=deadline)  # all at once, by the deadline
    groups = client.plan_runs([j[1] for j in jobs], deadline)  # neighbours: one fetch

    def fetch(ks: list[int]) -> list[ItemResult]:
        run = [(jobs[k][1], jobs[k][2], gates[k]) for k in ks]
        whole = client.read_run(run, deadline) if len(ks) > 1 else 0
        return [ItemResult(names[jobs[k][0]], size=jobs[k][1].size, data=jobs[k][3]) if n < whole
                else store._download(names[jobs[k][0]], jobs[k][1], jobs[k][2], jobs[k][3],
                                     out is not None and out[jobs[k][0]] is not None, gates[k], deadline)
                for n, k in enumerate(ks)]

    def late(k: int) -> ItemResult:
        gates[k].close()  # the abandoned read can no longer write into the caller's buffer
        store._cache.invalidate([jobs[k][1].path])
        return ItemResult(names[jobs[k][0]], error=exceeded(
            "a load", store.url, "load_timeout_secs", store.config.load_timeout_secs))

    try:  # always on the pool (hf_xet reads cannot be cancelled): waited for until the deadline
        futures = store._map(fetch, groups, inline=False, loads=True)
    except RuntimeError:  # the store was closed (its pool refuses work) part way through the submits
        # Invariant: a load returns only once no fetch of an item it fails can write into the
        # caller's buffer. The groups submitted before the refusal may still run: close their
        # gates here (close() ends the loads it knows of, but this one may have left by then).
        load.end()
        return None
    return list(zip(groups, store._gather(futures, deadline, lambda g: [late(k) for k in groups[g]], load),
                    strict=True))


__all__ = ["Load", "Loads", "fetch_jobs", "settled"]
