"""What the read path of HFBucketStore prepares, and when (stores/hub/client.py, stores/hub/xet/reads.py).

Counts and objects, never times: in a fresh process the first lookup paid for setting up HTTP
clients (loading CA certificates into TLS contexts) on the inference path; opening the store
now does that work instead, once.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvbucket.stores.hub.config import HFBucketConfig, build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import reads as xet_reads


def stored(hub_bucket: Any, prefix: str, names: list[str], sizes: list[int]
           ) -> tuple[HFBucketConfig, list[bytes]]:
    """Random objects of ``sizes`` written under ``prefix`` of the emulator's bucket: the store's
    config (to read them back with a store of the test's own) and their bytes."""
    import os

    data = [os.urandom(n) for n in sizes]
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/{prefix}",
                       token=hub_bucket.hub.write_token, token_env="", endpoint=hub_bucket.hub.endpoint)
    with HFBucketStore(cfg) as writer:
        assert all(r.ok for r in writer.put_many(list(zip(names, data, strict=True))))
    return cfg, data


def test_https_connections_share_one_tls_context() -> None:
    """http.client makes (and loads CA certificates into) a TLS context per connection unless
    given one; the reader's connections share one."""
    conns = xet_reads._Connections(4)
    c1, reused1 = conns.get("https", "cas.example:443", 5.0)
    c2, reused2 = conns.get("https", "cas.example:443", 5.0, fresh=True)
    c3, _ = conns.get("https", "other.example:443", 5.0)
    assert not reused1 and not reused2
    assert c1 is not c2
    assert c1._context is c2._context is c3._context is conns.tls()  # type: ignore[attr-defined]
    conns.close()


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://hub.example"])
def test_opening_a_store_makes_its_http_clients_so_the_first_lookup_does_not(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's process-wide client (which build_hf_headers only makes when telemetry
    is on) and, for an HTTPS Hub, the reader's TLS context exist once the store is open; no
    request is made."""
    from huggingface_hub.utils import _http

    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY", True)
    _http.close_session()
    made: list[object] = []
    factory = _http._GLOBAL_CLIENT_FACTORY

    def counting() -> object:
        made.append(factory())
        return made[-1]

    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", counting)
    store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b/p", token="hf_x", token_env="",
                                       endpoint=endpoint))
    try:
        assert len(made) == 1 and _http.get_session() is made[0]
        reader = store._client._reader
        assert (reader._conns._tls is not None) == endpoint.startswith("https:")
        assert not reader._conns._idle  # nothing was connected
    finally:
        store.close()
        _http.close_session()


def test_a_lookup_hands_its_hits_reconstructions_to_one_request_thread(hub_bucket: Any) -> None:
    """The lookup's thread submits one task; that task (on a request thread) submits a query per
    hit, so the lookup never waits for the threads that send them. A load that comes first asks
    for the ones not asked for yet: either way, one query per hit."""
    import os
    import threading

    from kvbucket.testing.hub_emulator.request_log import count_routes

    names = [f"h{i}" for i in range(8)]
    data = [os.urandom(20_000 + i) for i in range(8)]
    with HFBucketStore(build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/p",
                                    token=hub_bucket.hub.write_token, token_env="",
                                    endpoint=hub_bucket.hub.endpoint)) as writer:
        assert all(r.ok for r in writer.put_many(list(zip(names, data, strict=True))))
    with HFBucketStore(build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/p",
                                    token=hub_bucket.hub.write_token, token_env="",
                                    endpoint=hub_bucket.hub.endpoint)) as store:
        reader = store._client._reader
        submits: list[tuple[str, str]] = []
        real = reader._submit

        def recording(fn: Any, *args: Any) -> Any:
            submits.append((threading.current_thread().name, fn.__name__))
            return real(fn, *args)

        reader._submit = recording
        hub_bucket.hub.emulator.requests(clear=True)
        assert [r.size for r in store.head_many([*names, "missing"])] == [len(d) for d in data] + [None]
        me = threading.current_thread().name
        assert [s for s in submits if s[0] == me] == [(me, "prefetch")]
        got = store.get_many(names)
        assert [bytes(r.data) for r in got if r.data is not None] == data
        assert sorted(fn for _, fn in submits) == ["_query"] * 8 + ["prefetch"]  # no query twice
        routes = count_routes(hub_bucket.hub.emulator.requests(clear=True))
        assert routes.get("reconstruction") == 8 and routes.get("paths_info") == 1, routes


def test_opening_a_store_starts_its_load_and_request_threads() -> None:
    """A batch puts every object in flight at once; each worker started in that batch waited for
    the GIL while the first fetches copied bytes, stretching one round trip into several. Opening
    the store starts them, idle; no request is made (the endpoint listens nowhere)."""
    import threading

    from kvbucket.stores.hub import client as hub_client
    before = {t.name for t in threading.enumerate()}
    store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b/p", token="hf_x", token_env="",
                                       endpoint="http://127.0.0.1:9", load_concurrency=16))
    try:
        new = [t.name for t in threading.enumerate() if t.name not in before]
        assert sum(n.startswith("kvbucket-hfbucket-load") for n in new) == 16
        assert sum(n.startswith("kvbucket-hub-request") for n in new) == hub_client._REQUEST_THREADS
        assert store._client.prestart_threads() == 0  # already running: none more
    finally:
        store.close()


def test_a_load_parses_at_most_read_slots_bodies_at_once(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every object is requested at once, but only ``read_slots`` bodies are parsed at once (the
    others wait in their sockets or for a turn): each fetch takes a turn, never more than two at
    a time here, and the load still makes one reconstruction query and one fetch per object (runs
    off: a run is one body). turns.py keeps the rest (no turn held across a network wait)."""
    import threading
    import time

    monkeypatch.setattr(xet_reads, "RUN_OBJECTS", 1)

    from kvbucket.testing.hub_emulator.request_log import count_routes

    names = [f"s{i}" for i in range(8)]
    cfg, data = stored(hub_bucket, "slots", names, [300_000 + i for i in range(8)])

    class Recording:
        """One semaphore for both decoders' turns, counting holders."""

        def __init__(self, n: int) -> None:
            self.sem, self.lock = threading.BoundedSemaphore(n), threading.Lock()
            self.held = self.most = self.taken = 0

        def acquire(self, timeout: float | None = None) -> bool:
            if not self.sem.acquire(timeout=timeout):
                return False
            with self.lock:
                self.held, self.taken = self.held + 1, self.taken + 1
                self.most = max(self.most, self.held)
            time.sleep(0.01)  # hold it a while, so that the others would overlap without the bound
            return True

        def release(self) -> None:
            with self.lock:
                self.held -= 1
            self.sem.release()

    with HFBucketStore(cfg.model_copy(update={"read_slots": 2})) as store:
        turns = store._client._reader._turns
        assert turns is not None and turns.n == 2
        sem = turns._compiled = turns._python = Recording(2)  # type: ignore[assignment]
        hub_bucket.hub.emulator.requests(clear=True)
        got = store.get_many(names)
        assert [bytes(r.data) for r in got if r.data is not None] == data
        routes = count_routes(hub_bucket.hub.emulator.requests(clear=True))
    assert routes.get("reconstruction") == 8 and routes.get("fetch") == 8, routes
    assert sem.taken >= 8 and sem.most <= 2 and sem.held == 0


def test_parse_turns_are_on_by_default_whoever_the_peer(hub_bucket: Any) -> None:
    """Parse turns by default (one per core, at least 4; 4 while the Python decoder is in use),
    and nothing depends on the peer being this machine, so what a benchmark on loopback measures
    is the path users run; ``read_slots: 0`` parses every body as it arrives. The bytes are the
    same either way."""
    import inspect

    from kvbucket.stores.hub.xet import turns as xet_turns

    names = [f"n{i}" for i in range(6)]
    cfg, data = stored(hub_bucket, "remote", names, [200_000 + i for i in range(6)])
    assert cfg.read_slots == xet_turns.default_slots() >= xet_turns.PYTHON_TURNS == 4
    for slots in (None, 0, 3):
        c = cfg if slots is None else cfg.model_copy(update={"read_slots": slots})
        with HFBucketStore(c) as store:
            turns = store._client._reader._turns
            assert (turns is None) if slots == 0 else (turns is not None and turns.n == c.read_slots)
            got = store.get_many(names)
        assert [bytes(r.data) for r in got if r.data is not None] == data
    from kvbucket.stores.hub.xet import connections

    for mod in (xet_reads, connections, xet_turns):  # who the peer is is never asked
        assert "getpeername" not in inspect.getsource(mod) and "is_loopback" not in inspect.getsource(mod)


def load_checked(hub_bucket: Any, cfg: HFBucketConfig, names: list[str], data: list[bytes]) -> dict[str, int]:
    """Load ``names`` into fresh buffers, check every byte; the emulator's requests by route."""
    from kvbucket.testing.hub_emulator.request_log import count_routes

    with HFBucketStore(cfg) as store:
        hub_bucket.hub.emulator.requests(clear=True)
        bufs = [bytearray(len(d)) for d in data]
        got = store.get_many(names, bufs)
        routes = count_routes(hub_bucket.hub.emulator.requests(clear=True))
    assert all(r.ok for r in got) and [bytes(b) for b in bufs] == data
    return routes


def test_objects_stored_together_load_with_one_fetch_per_run(hub_bucket: Any) -> None:
    """Objects of one put_many sit back to back in one xorb: a load of more of them than
    read_connections reads them in runs of up to RUN_OBJECTS with one fetch each (still one
    reconstruction query per object), the bytes those of each object's own fetch; a load of no
    more than read_connections is one fetch per object (a real link caps each connection)."""
    names = [f"r{i}" for i in range(2 * xet_reads.RUN_OBJECTS)]
    cfg, data = stored(hub_bucket, "runs", names, [200_000 + 7 * i for i in range(len(names))])
    routes = load_checked(hub_bucket, cfg.model_copy(update={"read_connections": 2}), names, data)
    assert routes.get("reconstruction") == len(names) and routes.get("fetch") == 2, routes
    routes = load_checked(hub_bucket, cfg.model_copy(update={"read_connections": 4}), names, data)
    assert routes.get("fetch") == 4, routes  # runs of ceil(16 / 4) objects: four fetches in flight
    routes = load_checked(hub_bucket, cfg, names, data)  # the default budget, 64
    assert routes.get("fetch") == len(names), routes


def test_a_run_that_fails_midway_leaves_the_rest_to_their_own_fetch(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third object of a run fails to parse: the two before it count as read, it and the ones
    after it are read by their own fetches (from their first byte), and every object is right."""
    from kvbucket.errors import TransientStoreError
    from kvbucket.stores.hub.xet import decode as xet_decode
    names = [f"f{i}" for i in range(xet_reads.RUN_OBJECTS)]
    cfg, data = stored(hub_bucket, "runfail", names, [150_000 + 11 * i for i in range(len(names))])
    real = xet_decode.copy_range
    calls = [0]

    def flaky(*args: Any, **kw: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            real(*args, **kw)  # the object's bytes are written, then the read fails: the retry rewrites it
            raise TransientStoreError("the connection broke")
        real(*args, **kw)

    monkeypatch.setattr(xet_decode, "copy_range", flaky)
    routes = load_checked(hub_bucket, cfg.model_copy(update={"read_connections": 1}), names, data)
    assert routes.get("fetch") == 1 + len(names) - 2, routes  # the run, then one each for the rest


def test_big_objects_are_read_in_parts_in_parallel(hub_bucket: Any) -> None:
    """An object of at least twice read_part_bytes is read in parts: one reconstruction of its
    own range per part (asked all at once) and their fetches in parallel, each decoded into its
    own bytes of the caller's buffer. Compressed chunks make the parts' boundaries fall inside
    chunks (the shared chunk is written once, by the later part); every byte is right."""
    import time

    import numpy as np

    rng = np.random.default_rng(11)
    kv = (rng.standard_normal((5 << 20) // 2 + 3) * 0.05).astype(np.float32).view(np.uint32)
    packed = ((kv >> 16).astype(np.uint16)).tobytes()  # bf16-like: compresses, chunks unaligned
    names, sizes = ["big0", "big1", "small"], [(3 << 20) + 12_345, len(packed), 300_000]
    cfg, data = stored(hub_bucket, "parts", names[:1] + names[2:], [sizes[0], sizes[2]])
    with HFBucketStore(cfg.model_copy(update={"xet_compression": "bg4-lz4"})) as writer:
        assert writer.put_many([("big1", packed)])[0].ok
    data = [data[0], packed, data[1]]
    part = 512 << 10
    ranged = cfg.model_copy(update={"read_part_bytes": part})
    routes = load_checked(hub_bucket, ranged, names, data)
    parts = sizes[0] // part + sizes[1] // part + 1
    assert routes.get("reconstruction") == parts and routes.get("fetch", 0) >= parts, routes
    with HFBucketStore(ranged) as store:  # fresh buffers too, and a second (warm) load
        for _ in range(2):
            got = store.get_many(names)
            assert [bytes(r.data) for r in got if r.data is not None] == data
        path = store._path(names[1])
        meta = store._client.paths_info([path], time.monotonic() + 10)[path]
        assert meta is not None and meta.xet_hash
        rec = store._client._reader._cache[meta.xet_hash]
    spans = sorted((o, o + n) for f in rec.fetches for _, _, o, n in f.targets)
    assert spans[0][0] == 0 and spans[-1][1] == sizes[1]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # disjoint, tiling


def test_a_part_that_fails_or_is_late_leaves_the_object_right(hub_bucket: Any) -> None:
    """One part's fetch answered 503, another's cut mid-body, a third slow: the object is read
    again (its other parts are never left writing), and every byte is right."""
    names = ["p0", "p1"]
    cfg, data = stored(hub_bucket, "partfail", names, [(2 << 20) + 7, (2 << 20) + 9])
    ranged = cfg.model_copy(update={"read_part_bytes": 256 << 10, "retry_backoff_secs": 0.01})
    faults = hub_bucket.hub.faults
    faults.add("fetch", status=503, nth=3)
    faults.add("fetch", drop=True, nth=7)
    faults.add("fetch", latency_s=0.3, nth=5)
    try:
        load_checked(hub_bucket, ranged, names, data)
        assert sum(r["fired"] for r in faults.rules()) == 3
    finally:
        faults.reset()


def test_a_small_load_is_read_in_parts_that_fill_the_budget(hub_bucket: Any) -> None:
    """A load whose objects would be fewer fetches than read_connections reads them in smaller
    parts, down to read_min_part_bytes, each its own reconstruction and fetch, counted at the
    emulator: 4 x 1 MiB with a budget of 8 are 8 parts of 512 KiB; 8 of them fill it alone; one
    is 4 parts (the floor, 256 KiB: not 8 of 128 KiB); without a floor one fetch each. Every
    object's parts tile it exactly and each lands in its own bytes of the caller's buffer. (Parts
    are at least a Xet chunk's most, 128 KiB, so none falls inside one chunk: such a part has no
    bytes of its own and no fetch.)"""
    import time

    size = 1 << 20
    names = [f"b{i}" for i in range(8)]
    cfg, data = stored(hub_bucket, "budget", names, [size] * len(names))
    sized = cfg.model_copy(update={"read_connections": 8, "read_part_bytes": 4 << 20,
                                   "read_min_part_bytes": 256 << 10})
    for n, parts in ((4, 8), (8, 8), (1, 4)):
        routes = load_checked(hub_bucket, sized, names[:n], data[:n])
        assert routes.get("reconstruction") == parts and routes.get("fetch") == parts, (n, routes)
    unfloored = sized.model_copy(update={"read_min_part_bytes": 0})
    routes = load_checked(hub_bucket, unfloored, names[:4], data[:4])
    assert routes.get("reconstruction") == 4 and routes.get("fetch") == 4, routes
    with HFBucketStore(sized) as store:
        bufs = [bytearray(b"\xab" * size) for _ in range(4)]
        assert all(r.ok for r in store.get_many(names[:4], bufs))
        assert [bytes(b) for b in bufs] == data[:4]
        paths = [store._path(n) for n in names[:4]]
        meta = store._client.paths_info(paths, time.monotonic() + 10)
        for p in paths:
            rec = store._client._reader._cache[meta[p].xet_hash]  # type: ignore[union-attr]
            spans = sorted((o, o + k) for f in rec.fetches for _, _, o, k in f.targets if k)
            assert spans[0][0] == 0 and spans[-1][1] == size, spans
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # disjoint, tiling
            assert len(rec.fetches) == 2  # one fetch per part


def test_the_part_size_rule_counts_objects_read_whole() -> None:
    """part_sizes.part_size, shared by the Hub and S3: objects below two parts of the floor are one
    read each and take a connection of the budget; the rest fill what is left, never below the
    floor and never above read_part_bytes."""
    from kvbucket.stores.part_sizes import part_floor, part_ranges, part_size

    mib = 1 << 20

    def reads(sizes: list[int], budget: int = 64, part: int = 8 * mib, floor: int = mib) -> int:
        p = part_size(sizes, budget, part, floor)
        return sum(len(part_ranges(s, p)) for s in sizes)

    assert reads([2 * mib] * 32) == 64 and reads([2 * mib] * 64) == 64 and reads([8 * mib] * 16) == 64
    assert reads([2 * mib] * 32, floor=2 * mib) == 32  # below two floors: one fetch each
    assert reads([8 * mib] * 16, floor=2 * mib) == 64 and reads([8 * mib] * 16, floor=0) == 16
    assert reads([32 * mib] * 8, floor=0) == 32  # read_part_bytes parts whatever the floor
    # 32 small objects take 32 connections: 4 x 8 MiB fill the other 32 with 1 MiB parts, not 2 MiB
    assert reads([8 * mib] * 4 + [100_000] * 32) == 32 + 32
    assert reads([2 * mib] * 4, part=0) == 4 and part_floor(8 * mib, 0) == 8 * mib
    fields = HFBucketConfig.model_fields  # the store's defaults are the reader's
    assert fields["read_min_part_bytes"].default == xet_reads.MIN_PART_BYTES
    assert fields["read_part_bytes"].default == xet_reads.PART_BYTES


def _answer(skip: int, terms: list[tuple[int, int, int]]) -> dict[str, Any]:
    """A reconstruction answer: terms (chunk start, chunk end, bytes) of one xorb, one fetch."""
    lo, hi = min(t[0] for t in terms), max(t[1] for t in terms)
    return {"offset_into_first_range": skip,
            "terms": [{"hash": "x", "unpacked_length": n, "range": {"start": a, "end": b}}
                      for a, b, n in terms],
            "fetch_info": {"x": [{"range": {"start": lo, "end": hi}, "url": "u",
                                  "url_range": {"start": 0, "end": 99}}]}}


def test_parts_are_joined_into_disjoint_ranges_or_refused() -> None:
    """Parts sharing the chunk their boundary falls in: the earlier one's last term loses exactly
    that chunk; parts that leave a gap, or overlap by more than a term, are refused."""
    from kvbucket.errors import StoreError
    from kvbucket.stores.hub.xet.plans import join_parts, parse_part, part_ranges

    assert part_ranges(10, 0) == [(0, 10)] and part_ranges(10, 6) == [(0, 10)]
    assert part_ranges(10, 5) == [(0, 5), (5, 10)] and part_ranges(11, 3) == [(0, 3), (3, 7), (7, 11)]
    # chunks of 4 bytes: [0,4) [4,8) [8,12); parts [0,6) and [6,12): chunk 1 shared
    a = parse_part(_answer(0, [(0, 2, 8)]), 0)
    b = parse_part(_answer(2, [(1, 3, 8)]), 6)
    rec = join_parts([a, b], 12, 0.0)
    assert sorted(t for f in rec.fetches for t in f.targets) == [(0, 1, 0, 4), (1, 3, 4, 8)]
    with pytest.raises(StoreError):  # a gap: bytes 8-9 described by nobody
        join_parts([parse_part(_answer(0, [(0, 2, 8)]), 0), parse_part(_answer(0, [(2, 3, 2)]), 10)],
                   12, 0.0)
    with pytest.raises(StoreError):  # the second starts before the first's last term
        join_parts([parse_part(_answer(0, [(0, 1, 4), (1, 2, 4)]), 0),
                    parse_part(_answer(6, [(0, 3, 12)]), 6)], 12, 0.0)
    with pytest.raises(StoreError):  # the last part does not reach the end
        join_parts([parse_part(_answer(0, [(0, 2, 8)]), 0)], 12, 0.0)
    with pytest.raises(StoreError):  # an answer starting before its file
        parse_part(_answer(7, [(0, 1, 4)]), 6)


@pytest.mark.parametrize("route", ["fetch", "reconstruction"])
def test_a_part_failing_transiently_is_retried_on_its_own(hub_bucket: Any, route: str) -> None:
    """Issue 41's second tester (f_fault_amp): with objects read in 16 parts and 10% of fetches
    answered 503, 3 loads in 8 failed, each after whole-object retries. A part's request that
    fails transiently is now sent again on its own: every load is served with every byte right,
    and the requests sent beyond a load without faults are exactly the faulted ones (no part
    already read is asked for again, nor the other route's requests)."""
    from kvbucket.testing.hub_emulator.request_log import count_routes

    names = [f"f{i}" for i in range(8)]
    cfg, data = stored(hub_bucket, f"retry-{route}", names, [(4 << 20) + 3 * i for i in range(len(names))])
    ranged = cfg.model_copy(update={"read_part_bytes": 256 << 10, "retry_backoff_secs": 0.01})
    base = load_checked(hub_bucket, ranged, names, data)  # no faults: the requests of one load
    assert base.get("reconstruction") == base.get("fetch") == 16 * len(names), base
    faults = hub_bucket.hub.faults
    faults.add(route, status=503, probability=0.2)
    try:
        with HFBucketStore(ranged) as store:
            hub_bucket.hub.emulator.requests(clear=True)
            bufs = [bytearray(len(d)) for d in data]
            got = store.get_many(names, bufs)
            routes = count_routes(hub_bucket.hub.emulator.requests(clear=True))
        fired = faults.rules()[0]["fired"]
    finally:
        faults.reset()
    served = sum(1 for r, b, d in zip(got, bufs, data, strict=True) if r.ok and bytes(b) == d)
    assert served == len(names), [r.error for r in got]
    assert fired >= 10, fired
    other = "fetch" if route == "reconstruction" else "reconstruction"
    assert routes.get(route) == base[route] + fired, (routes, fired)
    assert routes.get(other) == base[other], routes


def test_a_part_whose_fetch_url_is_refused_is_asked_for_again_alone(hub_bucket: Any) -> None:
    """A part's fetch URL refused (403: expired) in an object read in parts: that part's range
    alone is asked for again and fetched from the fresh answer; the other parts are kept (before:
    every part of the object was asked for and fetched again)."""
    names = ["e0", "e1"]
    cfg, data = stored(hub_bucket, "refused", names, [(2 << 20) + 5, (2 << 20) + 11])
    ranged = cfg.model_copy(update={"read_part_bytes": 256 << 10, "retry_backoff_secs": 0.01})
    base = load_checked(hub_bucket, ranged, names, data)
    faults = hub_bucket.hub.faults
    faults.add("fetch", status=403, nth=5)
    faults.add("fetch", status=403, nth=12)
    try:
        routes = load_checked(hub_bucket, ranged, names, data)  # every byte right
        assert sum(r["fired"] for r in faults.rules()) == 2
    finally:
        faults.reset()
    assert routes.get("reconstruction") == base["reconstruction"] + 2, (routes, base)
    assert routes.get("fetch") == base["fetch"] + 2, (routes, base)
