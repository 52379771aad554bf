"""The metadata cache: a cached answer never replaces a newer write's (issue 29's first promise).

A lookup's paths-info answer made by the server before a put committed can arrive after the put
returned. Before: it overwrote the put's cache entry with the OLD xet hash, and a later load read
the old hash (on the Hub an overwritten file's old xorbs stay readable: the old bytes, served).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.meta_cache import MetaCache
from kvbucket.stores.hub.store import HFBucketStore

WAIT_S = 30.0  # generous bound on event waits; the test never measures speed


def _store(hub_bucket: Any) -> HFBucketStore:
    return HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/meta", token=hub_bucket.hub.write_token,
        endpoint=hub_bucket.hub.endpoint, token_env="", retry_backoff_secs=0.01,
        metadata_cache_ttl_secs=600.0,
    ))


def _paths_info_requests(hub: Any) -> int:
    return int(hub.stats()["routes"].get("paths_info", {}).get("requests", 0))


def test_a_lookup_answered_before_a_put_committed_does_not_replace_the_puts_entry(hub_bucket: Any) -> None:
    old, new = os.urandom(64 << 10), os.urandom(64 << 10)  # same size: a re-stored chunk
    with _store(hub_bucket) as store:
        assert store.put_many([("k", old)])[0].ok
        path = store._path("k")
        store._cache.clear()
        real = store._client.paths_info
        answered, put_done = threading.Event(), threading.Event()
        held: list[Any] = []

        def held_paths_info(paths: Any, deadline: float | None = None) -> Any:
            out = real(paths, deadline)  # the server answers now, before the put
            if not held:
                held.append(out[path].xet_hash)
                answered.set()
                assert put_done.wait(WAIT_S)  # ... and the answer arrives after the put returned
            return out

        store._client.paths_info = held_paths_info  # type: ignore[method-assign]
        sizes: list[Any] = []
        lookup = threading.Thread(target=lambda: sizes.extend(r.size for r in store.head_many(["k"])))
        lookup.start()
        assert answered.wait(WAIT_S)
        (r,) = store.put_many([("k", new)])
        assert r.ok, r.error
        put_done.set()
        lookup.join(WAIT_S)
        assert not lookup.is_alive() and sizes == [len(old)]
        store._client.paths_info = real  # type: ignore[method-assign]

        truth = real([path])[path].xet_hash
        assert held[0] != truth  # the held answer was the old one
        assert store._cache.get_many([path])[path].xet_hash == truth  # type: ignore[union-attr]
        before = _paths_info_requests(hub_bucket.hub)
        assert store.get("k") == new
        assert _paths_info_requests(hub_bucket.hub) == before  # read from the cached (put's) hash


def test_set_many_since_a_stamp_skips_keys_written_after_it() -> None:
    c: MetaCache[int] = MetaCache(60.0)
    s = c.stamp()
    c.set_written([("a", 2)])
    c.written(["b"])
    c.set_many([("a", 1), ("b", 1), ("c", 1)], since=s)
    assert c.get_many(["a", "b", "c"]) == {"a": 2, "c": 1}
    c.set_many([("a", 3)], since=c.stamp())  # asked after the write: a newer answer stands
    assert c.get_many(["a"]) == {"a": 3}
    c.set_many([("a", 4)])  # no stamp: as before
    assert c.get_many(["a"]) == {"a": 4}


def test_a_stamp_older_than_the_kept_write_epochs_caches_nothing(monkeypatch: Any) -> None:
    import kvbucket.stores.hub.meta_cache as mc

    monkeypatch.setattr(mc, "_WRITES_KEPT", 2)
    c: MetaCache[int] = MetaCache(60.0)
    s = c.stamp()
    c.written(["x", "y"])
    c.written(["z"])  # past the bound: the epochs are dropped, older stamps refused
    c.set_many([("x", 1), ("q", 1)], since=s)
    assert c.get_many(["x", "q"]) == {}
    c.set_many([("q", 1)], since=c.stamp())
    assert c.get_many(["q"]) == {"q": 1}
