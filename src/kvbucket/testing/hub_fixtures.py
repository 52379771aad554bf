"""Pytest fixtures around ``HubEmulator``; enable with ``pytest_plugins = ["kvbucket.testing.hub_fixtures"]``.

- ``hub_emulator`` (session): a running emulator with its own data dir and users as on the Hub:
  ``kvtest`` (the namespace of ``hub_bucket``; a write and a read token), ``kvmember`` (a member
  of the organisation ``kvorg`` with ``kvtest``) and ``kvother`` (in no organisation), each with
  ``write``, ``read`` and ``fine-read`` tokens (``hub.token(user, scope)``). Override the
  ``hub_orgs`` fixture (session scope) in a conftest to configure other organisations. It gives
  the process a private ``HF_XET_CACHE`` (hf_xet's shard cache never meets a
  server whose state it does not match) and hides any stored Hugging Face token (see
  ``isolate_hf_env``).
- ``hub_bucket`` (function): a fresh private bucket with a unique name; faults are reset before
  and after the test.
- ``hub_faults`` (function): the fault control, reset before and after the test.
- ``hub_tls_emulator`` (session) and ``hub_tls_bucket`` (function): the same over HTTPS with a
  throwaway CA, as the Hub serves it (TLS changes what a client's sockets do at a cut). Only
  while a ``hub_tls_bucket`` test runs does the process trust that CA (``trust_ca``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .hub_emulator import FaultControl, HubEmulator
from .tls import make_test_certificates

WRITE_USER = "kvtest"
MEMBER_USER = "kvmember"
OTHER_USER = "kvother"
ORG = "kvorg"
SCOPES = ("write", "read", "fine-read")


@dataclass
class RunningHub:
    """What the ``hub_emulator`` fixture yields."""

    emulator: HubEmulator
    write_token: str
    read_token: str
    namespace: str = WRITE_USER
    tokens: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)
    orgs: dict[str, list[str]] = field(default_factory=dict)

    def token(self, user: str, scope: str = "write") -> str:
        """The secret of ``user``'s token of ``scope`` (``write``, ``read`` or ``fine-read``)."""
        try:
            return self.tokens[(user, scope)]
        except KeyError:
            raise KeyError(f"no {scope} token for user {user!r} in this emulator") from None

    @property
    def endpoint(self) -> str:
        return self.emulator.endpoint

    @property
    def data_dir(self) -> Path:
        return self.emulator.data_dir

    @property
    def ca(self) -> Path | None:
        """The CA file a TLS emulator's certificate chains to (None over plain HTTP)."""
        return self.emulator.ca

    @property
    def faults(self) -> FaultControl:
        return self.emulator.faults

    def stats(self) -> dict[str, Any]:
        return self.emulator.stats()

    def api(self, token: str | bool | None = None) -> Any:
        """An ``HfApi`` on this emulator (write token unless told otherwise; ``False`` = anonymous)."""
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.write_token if token is None else token)

    def __repr__(self) -> str:  # keep tokens out of pytest's failure output
        return f"RunningHub(endpoint={self.endpoint!r}, data_dir={str(self.data_dir)!r})"


@dataclass
class HubBucket:
    """What the ``hub_bucket`` fixture yields: a fresh private bucket."""

    hub: RunningHub
    bucket_id: str

    @property
    def api(self) -> Any:
        return self.hub.api()


_ENV_VARS = ("HF_XET_CACHE", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_TOKEN")
_CONSTANTS = (
    "HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH", "HF_XET_CACHE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)  # fmt: skip


def isolate_hf_env(home: Path) -> dict[str, Any]:
    """Give this process a private Xet cache and no stored token; returns what ``restore_env`` needs.

    - ``HF_XET_CACHE``: hf_xet dedups uploads against the shards it cached; a cache that
      remembers xorbs this emulator never saw makes uploads fail ("references unknown xorb").
      hf_xet reads the variable when its session is first created in the process.
    - Token: huggingface_hub reads its token path at import into ``huggingface_hub.constants``
      (test modules import it before fixtures run), so the constants are patched too, and
      ``HF_TOKEN`` is unset: a client made with ``token=None`` never sends a real token here.
    - ``HF_HOME`` and the model cache are left alone: other tests in the same session may rely
      on models cached there.
    """
    saved: dict[str, Any] = {"env": {k: os.environ.get(k) for k in _ENV_VARS}}
    os.environ["HF_XET_CACHE"] = str(home / "xet")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.pop("HF_TOKEN", None)
    from huggingface_hub import constants

    saved["constants"] = {k: getattr(constants, k) for k in _CONSTANTS}
    new = {
        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_XET_CACHE": str(home / "xet"), "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
    }  # fmt: skip
    for k, v in new.items():
        setattr(constants, k, v)
    return saved


def restore_env(saved: dict[str, Any]) -> None:
    for k, v in saved["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    from huggingface_hub import constants

    for k, v in saved["constants"].items():
        setattr(constants, k, v)


@pytest.fixture(scope="session")
def hub_orgs() -> dict[str, list[str]]:
    """Organisations of the ``hub_emulator`` fixture: override (session scope) to configure others.

    Every user named here gets tokens too, alongside ``kvtest``, ``kvmember`` and ``kvother``.
    """
    return {ORG: [WRITE_USER, MEMBER_USER]}


def _running_hub(hub_orgs: dict[str, list[str]], *, tls: bool = False) -> Iterator[RunningHub]:
    """The session emulators' body: a private HF home, the users and tokens, the server (over
    HTTPS with certificates made in that home when ``tls``)."""
    home = Path(tempfile.mkdtemp(prefix="kvbucket-hfhome-"))
    saved = isolate_hf_env(home)
    users = dict.fromkeys([WRITE_USER, MEMBER_USER, OTHER_USER, *(u for m in hub_orgs.values() for u in m)])
    tokens = {(u, sc): f"hf_{sc[0]}{secrets.token_hex(12)}" for u in users for sc in SCOPES}
    specs = [f"{u}={secret}:{sc}" for (u, sc), secret in tokens.items()]
    try:
        certs = make_test_certificates(home) if tls else None
        with HubEmulator(tokens=specs, orgs=hub_orgs, tls=certs) as emu:
            yield RunningHub(
                emu, tokens[(WRITE_USER, "write")], tokens[(WRITE_USER, "read")], tokens=tokens,
                orgs={o: list(m) for o, m in hub_orgs.items()},
            )  # fmt: skip
    finally:
        restore_env(saved)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def hub_emulator(hub_orgs: dict[str, list[str]]) -> Iterator[RunningHub]:
    yield from _running_hub(hub_orgs)


@contextmanager
def trust_ca(ca: Path) -> Iterator[None]:
    """Make every Hub client this process starts trust only ``ca`` until the block ends.

    ``SSL_CERT_FILE`` is the one setting all three read: huggingface_hub's httpx2 client (when
    it is made: httpcore2's default context), hf_xet's reqwest/rustls (rustls-native-certs, when
    an upload or download session is made), and kvbucket's Xet reader (``ssl.create_default_context``,
    OpenSSL's default paths, when a store first fetches over TLS). huggingface_hub keeps one
    shared client, so it is closed on entry and exit: the next one is made with the trust in force.
    """
    from huggingface_hub import close_session

    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(ca)
    close_session()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = saved
        close_session()


@pytest.fixture
def hub_faults(hub_emulator: RunningHub) -> Iterator[FaultControl]:
    faults = hub_emulator.faults
    faults.reset()
    yield faults
    faults.reset()


def _fresh_bucket(hub: RunningHub) -> Iterator[HubBucket]:
    """A new private bucket of ``hub``'s write user, with the faults reset around the test."""
    hub.faults.reset()
    bucket_id = f"{hub.namespace}/t-{uuid.uuid4().hex[:16]}"
    hub.api().create_bucket(bucket_id, private=True)
    yield HubBucket(hub, bucket_id)
    hub.faults.reset()


@pytest.fixture
def hub_bucket(hub_emulator: RunningHub) -> Iterator[HubBucket]:
    yield from _fresh_bucket(hub_emulator)


@pytest.fixture(scope="session")
def hub_tls_emulator(hub_orgs: dict[str, list[str]]) -> Iterator[RunningHub]:
    """``hub_emulator`` over HTTPS: ``.endpoint`` is ``https://``, ``.ca`` the CA to trust."""
    yield from _running_hub(hub_orgs, tls=True)


@pytest.fixture
def hub_tls_bucket(hub_tls_emulator: RunningHub) -> Iterator[HubBucket]:
    """A fresh private bucket on ``hub_tls_emulator``; the process trusts its CA during the test."""
    assert hub_tls_emulator.ca is not None
    with trust_ca(hub_tls_emulator.ca):
        yield from _fresh_bucket(hub_tls_emulator)


def assert_all_tls(before: dict[str, Any], after: dict[str, Any], *routes: str) -> dict[str, int]:
    """Between two ``stats()["routes"]`` snapshots of a TLS emulator: every request came over
    TLS, and each of ``routes`` was asked at least once (a cell whose fetches went elsewhere,
    or never happened, proves nothing about TLS). Returns the requests per route in between."""
    def delta(name: str, key: str) -> int:
        return int(after.get(name, {}).get(key, 0)) - int(before.get(name, {}).get(key, 0))

    made = {name: delta(name, "requests") for name in after if delta(name, "requests")}
    plain = {name: n - delta(name, "tls") for name, n in made.items() if n != delta(name, "tls")}
    assert not plain, f"requests that did not come over TLS, per route: {plain}"
    missing = [r for r in routes if not made.get(r)]
    assert not missing, f"no {missing} request in between (requests per route: {made})"
    return made
