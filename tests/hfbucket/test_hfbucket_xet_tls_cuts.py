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
from typing import Any

import pytest

from kvbucket.stores.deadline import REAPER
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
