"""What the read path of HFBucketStore prepares, and when (stores/hub/client.py, stores/hub/xet/reads.py).

Counts and objects, never times: in a fresh process the first lookup paid for setting up HTTP
clients (loading CA certificates into TLS contexts) on the inference path; opening the store
now does that work instead, once.
"""

from __future__ import annotations

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


def test_a_load_reads_at_most_read_slots_bodies_at_once(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every object is requested at once, but only ``read_slots`` bodies are read and parsed at
    once (the others wait in their sockets): each fetch takes a slot, never more than two at a
    time here, and the load still makes one reconstruction query and one fetch per object (runs
    off: a run is one body). The parse windows are kept per slot: at most two were made."""
    import threading
    import time

    monkeypatch.setattr(xet_reads, "RUN_OBJECTS", 1)

    from kvbucket.testing.hub_emulator.request_log import count_routes

    names = [f"s{i}" for i in range(8)]
    cfg, data = stored(hub_bucket, "slots", names, [300_000 + i for i in range(8)])

    class Recording:
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

    with HFBucketStore(cfg) as store:
        slots = store._client._reader._slots = Recording(2)  # type: ignore[assignment]
        hub_bucket.hub.emulator.requests(clear=True)
        got = store.get_many(names)
        assert [bytes(r.data) for r in got if r.data is not None] == data
        routes = count_routes(hub_bucket.hub.emulator.requests(clear=True))
        windows = len(store._client._reader._windows)
    assert routes.get("reconstruction") == 8 and routes.get("fetch") == 8, routes
    assert slots.taken == 8 and slots.most <= 2
    assert 1 <= windows <= 2  # parse windows: one per slot in use, not one per load thread
    assert xet_reads.READ_SLOTS >= 2


def test_a_load_from_a_server_over_the_network_reads_every_body_as_it_arrives(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read slots only apply to a server on this machine: over a network a body left unread keeps
    its TCP window small and stalls its sender. With the peer taken for a remote one, no fetch
    waits for a slot, and the bytes are the same."""
    names = [f"n{i}" for i in range(6)]
    cfg, data = stored(hub_bucket, "remote", names, [200_000 + i for i in range(6)])

    class Counting:
        taken = 0

        def acquire(self, timeout: float | None = None) -> bool:
            Counting.taken += 1
            return True

        def release(self) -> None:
            pass

    seen: list[bool] = []
    real = xet_reads._on_loopback

    def remote(conn: Any) -> bool:
        seen.append(real(conn))
        return False

    monkeypatch.setattr(xet_reads, "_on_loopback", remote)
    with HFBucketStore(cfg) as store:
        store._client._reader._slots = Counting()  # type: ignore[assignment]
        got = store.get_many(names)
    assert [bytes(r.data) for r in got if r.data is not None] == data
    assert Counting.taken == 0
    assert seen and all(seen)  # the emulator itself is on loopback: the real check said so


@pytest.mark.parametrize(
    ("peer", "near"),
    [(("127.0.0.1", 80), True), (("127.3.4.5", 80), True), (("::1", 80, 0, 0), True),
     (("::ffff:127.0.0.1", 80, 0, 0), True), (("10.0.0.7", 443), False), (("2001:db8::1", 443, 0, 0), False),
     (("fe80::1%eth0", 443, 0, 2), False), (OSError("not connected"), False), (None, False)],
)
def test_only_a_loopback_peer_counts_as_this_machine(peer: Any, near: bool) -> None:
    class Sock:
        def getpeername(self) -> Any:
            if isinstance(peer, Exception):
                raise peer
            return peer

    class Conn:
        sock = None if peer is None else Sock()

    assert xet_reads._on_loopback(Conn()) is near  # type: ignore[arg-type]


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
    """Objects of one put_many sit back to back in one xorb: a load reads them in runs of up to
    RUN_OBJECTS with one fetch each (still one reconstruction query per object), the bytes those
    of each object's own fetch."""
    names = [f"r{i}" for i in range(2 * xet_reads.RUN_OBJECTS)]
    cfg, data = stored(hub_bucket, "runs", names, [200_000 + 7 * i for i in range(len(names))])
    routes = load_checked(hub_bucket, cfg, names, data)
    assert routes.get("reconstruction") == len(names) and routes.get("fetch") == 2, routes


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

    def flaky(*args: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            real(*args)  # the object's bytes are written, then the read fails: the retry rewrites it
            raise TransientStoreError("the connection broke")
        real(*args)

    monkeypatch.setattr(xet_decode, "copy_range", flaky)
    routes = load_checked(hub_bucket, cfg, names, data)
    assert routes.get("fetch") == 1 + len(names) - 2, routes  # the run, then one each for the rest
