"""A Xet fetch over TLS cut at its deadline (stores/deadline.py's reaper): what it reads after
the cut is never the TLS records themselves, and the load fails as late, not as damaged data.

Seen by an outside tester (24 threads through a TLS relay on a loaded host): "a fetched chunk
is not a valid LZ4 frame" on 1-2 items in 7 of 12 runs. ``SSLSocket.shutdown`` drops the
socket's TLS state; its later reads then return the encrypted records still queued on the
socket (Linux hands them out after a shutdown), which the decoder parsed as chunks. Real TLS
sockets on loopback, the reader's own connections and decoder."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import lz4.frame
import pytest

from kvbucket.errors import DeadlineExceededError, TransientStoreError
from kvbucket.stores.deadline import REAPER, Gate
from kvbucket.stores.hub.xet.plans import Fetch, Reconstruction
from kvbucket.stores.hub.xet.reads import XetReader
from kvbucket.stores.sockets import waiting_count
from kvbucket.testing.tls import TestCertificates as Certs
from kvbucket.testing.tls import make_test_certificates

TLS_RECORD = b"\x17\x03\x03"  # an application-data record's header (TLS 1.2 and 1.3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


def tls_pair(certs: Certs) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """Two ends of a TLS connection on loopback: (server side, client side)."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.cert, certs.key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca))
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        out: list[ssl.SSLSocket] = []
        accept = threading.Thread(target=lambda: out.append(server_ctx.wrap_socket(lsock.accept()[0],
                                                                                   server_side=True)))
        accept.start()
        client = client_ctx.wrap_socket(socket.create_connection(lsock.getsockname()),
                                        server_hostname="127.0.0.1")
        accept.join(5)
    return out[0], client


def wait_for(cond: Any, secs: float = 5.0) -> None:
    end = time.monotonic() + secs
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)


def test_a_tls_socket_cut_at_its_deadline_reads_no_record_as_plaintext(certs: Certs) -> None:
    """The reaper's cut with records still queued unread: every byte the socket gives after it
    is one the peer sent (decrypted), then the end; never the records' own bytes."""
    server, client = tls_pair(certs)
    try:
        sent = os.urandom(48_000)
        server.sendall(sent)
        wait_for(lambda: waiting_count(client.fileno()) >= 40_000)
        assert waiting_count(client.fileno()) >= 40_000  # encrypted records queued, none read yet
        watch = REAPER.watch(time.monotonic())
        REAPER.attach(watch, client)
        wait_for(lambda: watch.fired)
        assert watch.fired
        got = b""
        while len(got) <= len(sent):
            try:
                part = client.recv(65536)
            except OSError:  # an unexpected EOF may be raised instead of read as the end
                break
            if not part:
                break
            got += part
        REAPER.release(watch)
        assert not got.startswith(TLS_RECORD[:1])  # before: the first record's header, 17 03 03 ...
        assert sent.startswith(got)
    finally:
        server.close()
        client.close()


# ---- the whole read: a fetch whose reader is held up past its deadline ------------------------------
CHUNKS = 16
CHUNK = 64 << 10


def xet_body() -> tuple[bytes, bytes]:
    """A fetched range of ``CHUNKS`` LZ4-frame chunks (half random, half zeros: ~32 KiB each on
    the wire) and the object they make."""
    data, body = [], []
    for _ in range(CHUNKS):
        raw = os.urandom(CHUNK // 2) + bytes(CHUNK // 2)
        frame = lz4.frame.compress(raw)
        head = bytes([0]) + len(frame).to_bytes(3, "little") + bytes([1]) + CHUNK.to_bytes(3, "little")
        body.append(head + frame)  # version 0, compressed length, scheme 1 (LZ4 frame), length
        data.append(raw)
    return b"".join(body), b"".join(data)


class HeldFetch:
    """A TLS server answering one ranged GET with ``body``: its first ``first`` bytes at once,
    then nothing more until the test ends (a body stalled past the client's deadline). It
    neither reads nor sends after that: data reaching a socket shut for reading resets it
    (Linux), which would purge the records queued there."""

    def __init__(self, certs: Certs, body: bytes, first: int) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(certs.cert, certs.key)
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.body, self.first = body, first
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        raw, _ = self.lsock.accept()
        with self.ctx.wrap_socket(raw, server_side=True) as s:
            f = s.makefile("rb")
            while f.readline() not in (b"\r\n", b""):
                pass
            s.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % len(self.body)
                      + self.body[: self.first])
            self.done.wait(10)

    def close(self) -> None:
        self.done.set()
        self.lsock.close()
        self.thread.join(10)


class LateGate(Gate):
    """A read's gate whose first write is held until after ``until``: the load's thread
    descheduled at its deadline (the tester's host ran at load 5-20 on 2 cores)."""

    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        super().__init__()
        self.until = until

    def _late(self) -> None:
        while time.monotonic() < self.until:
            time.sleep(0.01)

    def write(self, view: memoryview, start: int, data: Any) -> None:
        self._late()
        super().write(view, start, data)

    def run(self, fn: Any, *args: Any) -> Any:
        self._late()
        return super().run(fn, *args)


@pytest.fixture
def reader(certs: Certs) -> Iterator[XetReader]:
    def submit(fn: Any, *args: Any) -> Future[Any]:
        raise RuntimeError("no request threads here")

    r = XetReader(lambda d, s: ("tok", 0, "https://127.0.0.1:9"), submit, concurrency=4,
                  request_timeout_secs=5.0, headers={}, read_slots=0, retries=0)
    r._conns._tls = ssl.create_default_context(cafile=str(certs.ca))
    yield r
    r.close()


@pytest.mark.parametrize("slots", [0, 1])
def test_a_fetch_cut_at_its_deadline_fails_as_late_not_as_damaged_data(
    certs: Certs, reader: XetReader, slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load whose thread was held up while its fetch's bytes sat on the socket: the reaper
    cuts the fetch at the deadline; the reader then finds the body ended early (a transient,
    late failure naming the deadline), never chunks made of TLS records ("not a valid LZ4
    frame", a plain StoreError that reads as damage, which the tester saw)."""
    from kvbucket.stores.hub.xet.turns import Turns

    monkeypatch.setenv("KVBUCKET_XET_DECODER", "python")  # no decoder load in the background mid-test
    reader._turns = Turns(slots) if slots else None
    body, data = xet_body()
    server = HeldFetch(certs, body, first=(256 + 48) << 10)
    try:
        url = f"https://127.0.0.1:{server.port}/xorb/abc?sig=1"
        fetch = Fetch(url, 0, len(body) - 1, 0, CHUNKS, ((0, CHUNKS, 0, len(data)),))
        reader._keep("h", Reconstruction((fetch,), len(data), time.monotonic() + 60))
        deadline = time.monotonic() + 1.0
        view = memoryview(bytearray(len(data)))
        with pytest.raises(TransientStoreError) as caught:
            reader.read_into("h", view, LateGate(deadline + 0.3), deadline)
        err = caught.value
        assert isinstance(err, DeadlineExceededError), repr(err)
        text = str(err)
        assert "deadline" in text and "cut" in text, text
        for damage in ("LZ4", "chunk", "valid", "version"):
            assert damage not in text, text
    finally:
        server.close()
