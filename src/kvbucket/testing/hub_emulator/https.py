"""The emulator's TLS mode: its server context, and admin calls that trust its CA.

Why: the Hub and its Xet CAS are served only over HTTPS, and TLS changes what a client's socket
does at a cut (an ``SSLSocket`` shut at a deadline gave its encrypted records as chunk bytes;
tests/hfbucket/test_hfbucket_xet_tls_cuts.py). The emulator serves the same routes over TLS so
the suites can run on the transport production uses. Its own admin calls (faults, stats, the
request log, collection) take the CA per call, never from the process environment, so a test
trusts it without changing what every other client in the process trusts.
"""

from __future__ import annotations

import ssl
import urllib.request
from http.client import HTTPResponse
from pathlib import Path


def server_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """The context the emulator's listening socket serves TLS with (``cert`` chains to the CA
    the clients are given)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def admin_open(req: urllib.request.Request | str, timeout: float, ca: str | Path | None) -> HTTPResponse:
    """``urlopen`` for the emulator's control routes: over TLS it trusts ``ca`` (the emulator's
    own CA) for this call only; over plain HTTP it is ``urlopen`` as before."""
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    return urllib.request.urlopen(req, timeout=timeout, context=context)  # type: ignore[no-any-return]
