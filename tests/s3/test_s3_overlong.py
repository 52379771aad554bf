"""A server that sends more than its Content-Length: never another key's bytes, never a reused
connection (issue 39). Against a raw-socket server on 127.0.0.1 (kvbucket.testing.overlong_server),
through S3Store's real read paths: libcurl's direct reads and obstore's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvbucket.errors import TransientStoreError
from kvbucket.stores.guard.sealed import SealedStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.overlong_server import OverlongServer
from kvbucket.testing.tls import make_test_certificates

SIZE = 4096
OBJECTS = {k: k.encode() * SIZE for k in ("a", "b", "c")}  # same size: the length check cannot tell


def open_store(server: OverlongServer, **overrides: object) -> S3Store:
    cfg: dict[str, object] = {
        "s3_endpoint": "s3://bkt", "s3_endpoint_url": server.url, "s3_region": "us-east-1",
        "aws_access_key_id": "AKIAOVERLONGTEST", "aws_secret_access_key": "s" * 40,
        "s3_num_io_threads": 1, "s3_max_retries": 0, "s3_breaker_failures": 0,
    }
    cfg.update(overrides)
    return S3Store(S3Config.parse(cfg))


@pytest.fixture
def same_write() -> Iterator[OverlongServer]:
    """Every answer of "a" is followed, in the same write, by a whole answer with "b"'s bytes."""
    with OverlongServer(OBJECTS, overlong={"a"}) as s:
        yield s


def load(store: S3Store, key: str) -> tuple[bytes | None, Exception | None]:
    buf = bytearray(SIZE)
    (r,) = store.get_many([key], [buf])
    return (bytes(buf) if r.found else None), r.error


def test_direct_reads_refuse_an_over_long_answer_and_never_reuse_its_connection(
    same_write: OverlongServer,
) -> None:
    with open_store(same_write) as store:
        for _ in range(10):
            data, err = load(store, "a")
            assert data is None and isinstance(err, TransientStoreError)
            assert "more bytes than the Content-Length" in str(err) and "AKIA" not in str(err)
            assert load(store, "c") == (OBJECTS["c"], None)  # never "b"'s bytes left from "a"
    conns = same_write.connections_of("GET")
    assert len(conns) == 20
    # A request after an over-long answer always came on a new connection; "c" after "c" may reuse.
    assert all(conns[i + 1] != conns[i] for i in range(0, 20, 2))


def test_a_batch_refuses_only_the_over_long_item(same_write: OverlongServer) -> None:
    """Many rounds: libcurl may hand a finished answer's connection to the next transfer within
    the same ``perform`` call, before kvbucket sees the first one finish (about 1 batch in 10
    here). The check before that request is sent judges the connection; a close or bytes seen
    after it are the later request's. Judged after, an honest "b" was refused when the next "a"
    closed the connection it had left intact, and honest requests were sent twice."""
    names = ["c", "a", "b", "c", "b", "a", "c"]
    rounds = 60
    with open_store(same_write, s3_num_io_threads=2) as store:
        for _ in range(rounds):
            bufs = [bytearray(SIZE) for _ in names]
            results = store.get_many(names, bufs)
            for name, r, buf in zip(names, results, bufs, strict=True):
                if name == "a":
                    assert not r.found and isinstance(r.error, TransientStoreError)
                else:
                    assert r.found and bytes(buf) == OBJECTS[name], name
    assert len(same_write.connections_of("GET")) == rounds * len(names)  # none sent twice


def test_bytes_arriving_after_an_answer_are_never_read_as_the_next_one() -> None:
    """The issue's case: the extra answer comes a moment after the body and sits on the idle
    connection until the next load; that load must not take it (libcurl itself only checks a
    connection idle for a second). obstore's path is left out: hyper drops such a connection
    when its connection task sees the bytes first, and a request taking the connection in the
    same instant reads them (1-3 loads in 200 here, a limit of hyper's, in docs/s3.md)."""
    with OverlongServer(OBJECTS, overlong={"a"}, pause=0.005) as server, open_store(server) as store:
        for _ in range(30):
            server.sent.clear()
            data, err = load(store, "a")
            assert data in (OBJECTS["a"], None) and (data is not None or err is not None)
            assert server.sent.wait(10)  # the extra bytes are on this client's socket now
            assert load(store, "c") == (OBJECTS["c"], None)
        conns = server.connections_of("GET")
    assert all(conns[i + 1] != conns[i] for i in range(0, len(conns) - 1, 2))


def test_obstore_never_serves_another_keys_bytes_from_an_over_long_answer(
    same_write: OverlongServer,
) -> None:
    """obstore (hyper) cannot say an answer was over-long: it serves the announced bytes (here
    the object's own) and drops the connection; it never reads the rest as the next answer."""
    with open_store(same_write, s3_direct_reads=False) as store:
        for _ in range(10):
            assert load(store, "a")[0] in (OBJECTS["a"], None)
            assert load(store, "c") == (OBJECTS["c"], None)
    reqs = same_write.requests
    assert len(reqs) == 20
    assert all(reqs[i + 1][0] != reqs[i][0] for i in range(19) if reqs[i][2] == "a")


def test_a_head_answered_with_a_body_is_refused_and_its_connection_dropped() -> None:
    with OverlongServer(OBJECTS, overlong=set(), head_body=True) as server, open_store(server) as store:
        for _ in range(5):
            (r,) = store.head_many(["a"])
            assert r.size is None and isinstance(r.error, TransientStoreError)
        heads = server.connections_of("HEAD")
    assert len(heads) == 5 and len(set(heads)) == 5


def test_a_well_behaved_server_never_has_an_answer_refused(seaweedfs: Any, s3_bucket: str) -> None:
    """The check at a transfer's end must not take the answer to a request libcurl has just put on
    the same connection (within the same step) for excess: 4 of 2,560 loads were refused so
    before the check looked for a transfer sharing the connection."""
    cfg = S3Config.parse(seaweedfs.config(s3_bucket, s3_num_io_threads=16))
    names = [f"o{i}" for i in range(64)]
    data = {n: os.urandom(64 * 1024) for n in names}
    with S3Store(cfg) as store:
        assert all(r.ok for r in store.put_many(list(data.items())))
        for _ in range(30):
            bufs = [bytearray(64 * 1024) for _ in names]
            results = store.get_many(names, bufs)
            assert all(r.found and r.error is None for r in results), [r.error for r in results if r.error]
            assert all(bytes(b) == data[n] for n, b in zip(names, bufs, strict=True))
            assert all(r.size == 64 * 1024 for r in store.head_many(names))


def test_over_tls_a_sealed_store_refuses_a_forged_answer_as_a_miss(tmp_path: Any) -> None:
    """Over TLS excess sharing a record with a body's end waits decrypted in the TLS library,
    where no socket check sees it (docs/s3.md): the next request on the connection reads it,
    here a whole forged answer carrying "b"'s bytes. The sealed format (the default) binds a
    chunk to its name, so what was read for another name is a miss, never served."""
    certs = make_test_certificates(tmp_path)
    payloads = {k: os.urandom(16384) for k in ("a", "b", "c")}  # 16 KiB: the body ends a record
    mem = MemoryStore()
    assert all(r.ok for r in SealedStore(mem, tier="remote").put_many(list(payloads.items())))
    sealed = {r.name: bytes(r.data) for r in mem.get_many(list(payloads))}
    names = ["a", "b", "c", "b", "a", "c", "c", "b"]
    refused = 0
    with OverlongServer(sealed, overlong={"a"}, tls=(str(certs.cert), str(certs.key))) as server:
        assert server.url.startswith("https://")
        inner = open_store(server, s3_ca_bundle=str(certs.ca), s3_num_io_threads=1)
        with SealedStore(inner, tier="remote") as store:
            for _ in range(20):
                bufs = [bytearray(16384) for _ in names]
                for name, r, buf in zip(names, store.get_many(names, bufs), bufs, strict=True):
                    if r.found:
                        assert bytes(buf) == payloads[name], name  # never another name's bytes
                    else:
                        refused += name != "a"
    assert refused > 0  # forged answers were read (and refused): the case was exercised
