"""One slow answer fails the calls of one budget, not every later call (issue 29 item 3).

The emulator trickles one answer (``trickle_s``: a byte every 0.2 s, headers at once, so no
per-read timeout ever trips). Before: a trickled read-token answer made loads and lookups fail
for ~42 s (the token request ran on a request thread under the token lock, 63 threads waited
for it, the request pool was never replaced); a trickled reconstruction answer failed the
loads of its object for 29 s (its query's future was handed to each of them). Now the calls of
the budget that met the slow answer fail at their deadline; the next ones succeed. Time bounds
are multiples of the configured budgets, never of measured speed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvbucket.errors import DeadlineExceededError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.hub_emulator.request_log import count_routes

LOAD_S = 2.0
LOOKUP_S = 1.0
TRICKLE_S = 0.2  # per byte: a token answer (~300 bytes) takes a minute


def _store(hub_bucket: Any) -> HFBucketStore:
    return HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/slow", token=hub_bucket.hub.write_token,
        endpoint=hub_bucket.hub.endpoint, token_env="", retry_backoff_secs=0.01, breaker_failures=0,
        load_timeout_secs=LOAD_S, lookup_timeout_secs=LOOKUP_S,
    ))


def _written(hub_bucket: Any, count: int) -> tuple[list[str], list[bytes]]:
    names = [f"o{i:02d}" for i in range(count)]
    data = [os.urandom(8192 + i) for i in range(count)]
    with _store(hub_bucket) as writer:
        assert all(r.ok for r in writer.put_many(list(zip(names, data, strict=True))))
    return names, data


def test_a_trickled_read_token_fails_one_load_not_the_next_ones(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    names, data = _written(hub_bucket, 32)
    hub.faults.add("xet_token", trickle_s=TRICKLE_S, times=1)
    with _store(hub_bucket) as store:  # a new store: no read token yet
        hub.emulator.requests(clear=True)
        t0 = time.monotonic()
        first = store.get_many(names)
        took = time.monotonic() - t0
        assert all(isinstance(r.error, DeadlineExceededError) for r in first), first[0]
        assert took < LOOKUP_S + 2 * LOAD_S  # its budget (and the lookup part), not the trickle
        # the next lookup and load work at once, the token's slow answer still coming in
        assert [r.size for r in store.head_many(names)] == [len(d) for d in data]
        got = store.get_many(names)
        assert [bytes(r.data) for r in got if r.data is not None] == data, [r.error for r in got][:2]
        # the slow one (still coming in: not in the log yet), then one for every later load
        assert [(r["seen"], r["fired"]) for r in hub.faults.rules()] == [(2, 1)]
        assert count_routes(hub.emulator.requests(clear=True)).get("xet_token") == 1


def test_a_trickled_reconstruction_fails_one_load_of_its_object_not_the_next(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    names, data = _written(hub_bucket, 4)
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.get_many(names[1:]))  # token and connections warm
        hub.faults.add("reconstruction", trickle_s=TRICKLE_S, times=1)
        # The lookup asks for the hit's reconstruction in the background (its own deadline:
        # request_timeout_secs, 30 s); that answer trickles.
        assert [r.size for r in store.head_many(names[:1])] == [len(data[0])]
        t0 = time.monotonic()
        (first,) = store.get_many(names[:1])  # joins the slow query, until its own budget
        assert isinstance(first.error, DeadlineExceededError), (first.error, hub.faults.rules())
        assert time.monotonic() - t0 < 2 * LOAD_S
        (second,) = store.get_many(names[:1])  # not handed the stuck query: asks again
        assert second.data is not None and bytes(second.data) == data[0], second.error
        (third,) = store.get_many(names[:1])
        assert third.data is not None and bytes(third.data) == data[0], third.error
        assert [r["fired"] for r in hub.faults.rules()] == [1]


def test_a_trickled_fetch_ends_at_the_loads_deadline_and_frees_its_thread(hub_bucket: Any) -> None:
    """The fetch's socket is shut at the load's deadline (it read until the trickle ended)."""
    import threading

    hub = hub_bucket.hub
    names, data = _written(hub_bucket, 2)
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.get_many(names))
        hub.faults.add("fetch", trickle_s=TRICKLE_S, times=1)
        store._client._reader._cache.clear()
        before = set(threading.enumerate())
        (first,) = store.get_many(names[:1])
        assert isinstance(first.error, DeadlineExceededError), first
        (second,) = store.get_many(names[:1])
        assert second.data is not None and bytes(second.data) == data[0], second.error
        # no load thread is left reading the trickle: the pool was not abandoned for it
        assert not [t for t in set(threading.enumerate()) - before if "hfbucket-load" in t.name]
