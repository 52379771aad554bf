"""A load's critical path on the Hub emulator, counted from the emulator's request log.

With latency on every request, a lookup + load of a prompt's chunks must not depend on how many
chunks there are: the lookup and the read token together, then every object's reconstruction at
once, then every fetch at once (issue 23). Counts, never times: the log gives each request's
connection and place in the server's order of events, and the credentials it used and handed
out; the longest chain of requests each provably sent after the previous one's answer was
received is the number of sequential round trips (request_log: causal order, not time gaps).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest

from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.hub_emulator.request_log import count_routes, sequential_round_trips

# Added to every request. Round trips are counted from causal order, so a request the emulator
# noticed late (its event loop shares this process's GIL with the store's 64 load threads: with
# time gaps, 0.2 s and then 0.5 s of latency each failed once in CI, a warm batch's 64 fetches
# counting 2 chains) no longer counts a chain; what remains is a client thread so late that it
# reused a connection whose answer had come, which the latency makes take a whole second.
LATENCY_S = 1.0


def _store(hub_bucket: Any, **options: Any) -> HFBucketStore:
    # Budgets far above the added latency: these tests count round trips, not deadlines.
    options = {"lookup_timeout_secs": 30.0, "load_timeout_secs": 60.0, **options}
    return HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/rt", token=hub_bucket.hub.write_token,
        endpoint=hub_bucket.hub.endpoint, token_env="", retry_backoff_secs=0.01, **options,
    ))


@pytest.mark.parametrize(("count", "size", "part"),
                         [(64, 64 << 10, 0), (16, 256 << 10, 0), (4, 1 << 20, 256 << 10)],
                         ids=["64x64KiB", "16x256KiB", "4x1MiB-in-parts"])
def test_lookup_and_load_take_a_constant_number_of_round_trips(hub_bucket: Any, count: int, size: int,
                                                               part: int) -> None:
    """Lookup + read token, reconstructions, fetches: three round trips whatever the count, and
    for objects read in parts too (every part's reconstruction asked with the others, every
    part's fetch sent with the others)."""
    hub = hub_bucket.hub
    names = [f"c{i:03d}" for i in range(count)]
    data = [os.urandom(size) for _ in names]
    with _store(hub_bucket) as writer:
        assert all(r.ok for r in writer.put_many(list(zip(names, data, strict=True))))
    hub.faults.add("*", latency_s=LATENCY_S)
    hub.emulator.requests(clear=True)
    parts = max(1, size // part) if part else 1
    with _store(hub_bucket, read_part_bytes=part) as store:  # a new store: cold metadata cache, no token
        assert [r.size for r in store.head_many(names)] == [size] * count
        bufs = [bytearray(size) for _ in names]
        got = store.get_many(names, bufs)
        assert [r.ok for r in got] == [True] * count
        assert bufs == [bytearray(d) for d in data]
        log = hub.emulator.requests(clear=True)
        routes = count_routes(log)
        assert routes.get("xet_token") == 1, routes  # one read token per store, shared by every stream
        assert routes.get("paths_info") == 1, routes  # the load used the lookup's metadata
        # the lookup asked for every hit's reconstruction; the load waited for those, asked none
        assert routes.get("reconstruction") == count * parts, routes
        assert routes.get("fetch", 0) >= count * parts, routes
        # paths-info and the read token together, the reconstructions, the fetches
        assert sequential_round_trips(log) <= 3, (sequential_round_trips(log), routes)

        # A second batch on the same store: token, reconstructions and connections are warm.
        got = store.get_many(names, [None] * count)
        assert [bytes(r.data) for r in got if r.data is not None] == data
        log = hub.emulator.requests(clear=True)
        assert set(count_routes(log)) == {"fetch"}, count_routes(log)
        assert sequential_round_trips(log) == 1, count_routes(log)


def test_the_load_concurrency_bounds_what_is_in_flight(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_concurrency`` is the bound: 4 at a time makes the fetches of 16 objects 4 waves
    (one fetch per object: runs off, or the 16 objects of one put_many would be two fetches)."""
    from kvbucket.stores.hub.xet import reads as xet_reads
    monkeypatch.setattr(xet_reads, "RUN_OBJECTS", 1)
    hub = hub_bucket.hub
    names = [f"w{i:02d}" for i in range(16)]
    with _store(hub_bucket) as writer:
        assert all(r.ok for r in writer.put_many([(n, os.urandom(32 << 10)) for n in names]))
    hub.faults.add("*", latency_s=LATENCY_S)
    with _store(hub_bucket, load_concurrency=4) as store:
        store.head_many(names)
        hub.emulator.requests(clear=True)
        assert all(r.ok for r in store.get_many(names))
        log = hub.emulator.requests(clear=True)
        assert sequential_round_trips(log) >= 4, count_routes(log)


def test_round_trips_come_from_causal_order_not_from_when_the_server_noticed() -> None:
    """Connections and credentials make the edges: a request noticed after another's answer, on
    a connection of its own and with nothing that answer handed out, is not a second round trip."""
    def e(conn: str, seq: tuple[int, int], uses: tuple[str, ...] = (), hands: tuple[str, ...] = ()
          ) -> dict[str, Any]:
        # start/end as the time-gap count would see them: every request after the previous one
        return {"route": "fetch", "start": seq[0], "end": seq[1], "conn": conn, "seq": list(seq),
                "uses": list(uses), "hands": list(hands)}

    late_batch = [e("a", (0, 1)), e("b", (2, 3)), e("c", (4, 5))]  # sent together, noticed one by one
    assert sequential_round_trips(late_batch) == 1
    assert sequential_round_trips([{k: x[k] for k in ("route", "start", "end")} for x in late_batch]) == 3
    same_conn = [e("a", (0, 1)), e("a", (2, 3)), e("a", (4, 5))]  # each sent after the answer before
    assert sequential_round_trips(same_conn) == 3
    token_then_query_then_fetch = [
        e("t", (0, 1), hands=("tok",)), e("q", (2, 3), uses=("tok",), hands=("url",)),
        e("f", (4, 5), uses=("url",)), e("g", (6, 7), uses=("nothing-handed",)),
    ]
    assert sequential_round_trips(token_then_query_then_fetch) == 3
    used_before_answered = [e("t", (0, 3), hands=("tok",)), e("q", (1, 2), uses=("tok",))]  # not caused by it
    assert sequential_round_trips(used_before_answered) == 1


def test_sequential_round_trips_counts_the_longest_waiting_chain() -> None:
    def e(route: str, start: float, end: float) -> dict[str, Any]:
        return {"route": route, "start": start, "end": end}

    assert sequential_round_trips([]) == 0
    parallel = [e("fetch", 0.0, 1.0) for _ in range(10)]
    assert sequential_round_trips(parallel) == 1
    chain = [e("a", 0, 1), e("b", 1.5, 2), e("c", 2.5, 3), e("d", 0.1, 2.9)]  # d overlaps all three
    assert sequential_round_trips(chain) == 3
    assert sequential_round_trips([*chain, e("telemetry", 3.5, 4)]) == 3  # fire and forget
    assert sequential_round_trips([e("x", 5, 6), e("y", 0, 1), e("z", 2, 3)]) == 3  # any order


def test_reconstructions_expire_and_refused_fetch_urls_are_asked_for_again(hub_bucket: Any) -> None:
    """Fetch URLs are presigned and expire: a cached reconstruction is reused only briefly, and a
    fetch the storage refuses (403) gets a fresh reconstruction once, then succeeds."""
    from kvbucket.stores.hub.xet import reads as xet_reads
    hub = hub_bucket.hub
    names = [f"e{i}" for i in range(4)]
    data = [os.urandom(100_000) for _ in names]
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.put_many(list(zip(names, data, strict=True))))
        assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
        hub.emulator.requests(clear=True)
        assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
        assert "reconstruction" not in count_routes(hub.emulator.requests(clear=True))  # cached
        cache = store._client._reader._cache
        for h, rec in list(cache.items()):  # as they are RECONSTRUCTION_TTL_SECS later
            cache[h] = dataclasses.replace(rec, expires=time.monotonic() - 1)
        assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
        assert count_routes(hub.emulator.requests(clear=True))["reconstruction"] == 4  # expired: again
        assert 0 < xet_reads.RECONSTRUCTION_TTL_SECS <= 300

        assert [bytes(r.data) for r in store.get_many(names[:1]) if r.data is not None] == data[:1]
        hub.faults.add("fetch", status=403, nth=1)
        hub.emulator.requests(clear=True)
        assert [bytes(r.data) for r in store.get_many(names[:1]) if r.data is not None] == data[:1]
        routes = count_routes(hub.emulator.requests(clear=True))
        assert routes == {"fetch": 2, "reconstruction": 1}, routes


def test_compressed_and_deduplicated_objects_are_read_without_hf_xet(hub_bucket: Any) -> None:
    """LZ4 and byte-grouped chunks (text, small integers), chunks shared between objects and
    within one, objects spanning several xorbs: all decoded by kvbucket's reader (hf_xet's stream,
    the fallback, is never opened), every byte checked."""
    import numpy as np

    rng = np.random.default_rng(7)
    block = os.urandom(300_000)
    objects = {
        "text": b"the quick brown fox jumps over the lazy dog\n" * 50_000,
        "ints": rng.integers(0, 1000, 400_000, dtype=np.int32).tobytes(),  # byte grouping helps
        "zeros": bytes(3 << 20),
        "repeats": block * 5,  # the same chunks several times in one object
        "shared": os.urandom(100_000) + block + os.urandom(100_000),  # chunks another object holds
        "big": os.urandom(70 << 20),  # past one 64 MiB xorb
        "tiny": b"x",
    }
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.put_many(list(objects.items())))
    with _store(hub_bucket) as store:
        got = store.get_many(list(objects))
        assert {r.name: bytes(r.data) for r in got if r.data is not None} == objects
        assert store._client._download_group is None  # no object needed hf_xet's stream


def test_a_kept_alive_connection_the_server_closed_is_replaced_transparently(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections stay open between batches; one the server closed meanwhile (its idle timeout)
    is replaced on the spot, not counted as a failed read (no retry, no backoff). One fetch per
    object here (no runs), so that eight connections are kept and closed."""
    import socket

    from kvbucket.stores.hub.xet import reads as xet_reads
    monkeypatch.setattr(xet_reads, "RUN_OBJECTS", 1)

    hub = hub_bucket.hub
    names = [f"k{i}" for i in range(8)]
    data = [os.urandom(50_000) for _ in names]
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.put_many(list(zip(names, data, strict=True))))
        assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
        idle = [c for q in store._client._reader._conns._idle.values() for c in list(q.queue)]
        assert idle  # kept for the next batch
        for conn in idle:  # as a server ending idle keep-alive connections does
            assert conn.sock is not None
            conn.sock.shutdown(socket.SHUT_RDWR)
        hub.emulator.requests(clear=True)
        assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
        assert count_routes(hub.emulator.requests(clear=True)) == {"fetch": 8}  # no paths-info: no retry


def test_the_read_token_is_renewed_before_it_expires_and_only_then(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    names = ["t0", "t1", "t2"]
    with _store(hub_bucket) as store:
        assert all(r.ok for r in store.put_many([(n, os.urandom(10_000)) for n in names]))
        hub.emulator.requests(clear=True)
        assert all(r.ok for r in store.get_many(names))
        assert all(r.ok for r in store.get_many(names))
        assert count_routes(hub.emulator.requests(clear=True)).get("xet_token") == 1
        client = store._client
        token, _, cas = client._read_token.current
        client._read_token.current = (token, int(time.time()) + 30, cas)  # as it is shortly before expiry
        store._client._reader._cache.clear()  # the next load asks for reconstructions again
        assert all(r.ok for r in store.get_many(names))
        assert all(r.ok for r in store.get_many(names))
        routes = count_routes(hub.emulator.requests(clear=True))
        assert routes.get("xet_token") == 1, routes  # renewed once, by the loads that needed it
        assert client._read_token.current[1] > time.time() + 600


def test_short_lived_xet_tokens_are_used_for_most_of_their_life(tmp_path: Any) -> None:
    """Tokens issued for 30 s (``kvbucket emulator --xet-token-ttl 30``): with a flat 60 s safety
    margin each was stale on arrival, and a 32-object load asked for 33 (issue 29 item 8). Now
    a token is renewed a quarter of its lifetime before it expires: one read token for two
    loads, and kvbucket's write token reused by a second store (hf_xet renews the tokens of its
    upload requests itself through the refresh URL, by its own rule: those are not counted)."""
    from kvbucket.testing.hub_emulator import HubEmulator

    with HubEmulator(tmp_path / "hub", xet_token_ttl_s=30) as emu:
        names = [f"s{i:02d}" for i in range(32)]
        data = [os.urandom(4096) for _ in names]
        config = build_config(bucket_handle="hf://buckets/local/short-tokens", token_env="",
                              endpoint=emu.endpoint, create_bucket_if_missing=True, retry_backoff_secs=0.01)
        with HFBucketStore(config) as store:
            assert all(r.ok for r in store.put_many(list(zip(names[:16], data[:16], strict=True))))
            first = store._client._write_token.current
            assert all(r.ok for r in store.put_many(list(zip(names[16:], data[16:], strict=True))))
            reused = first is not None and store._client._write_token.current is first
            assert reused, "the write token was asked for again"  # (a message: no token in the output)
        with HFBucketStore(config) as store:
            emu.requests(clear=True)
            assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
            store._client._reader._cache.clear()  # the second load asks for reconstructions again
            assert [bytes(r.data) for r in store.get_many(names) if r.data is not None] == data
            routes = count_routes(emu.requests(clear=True))
            assert routes.get("xet_token") == 1 and routes.get("reconstruction") == 64, routes
