"""Who may do what: users, organisations and Hub tokens, and short-lived signed Xet tokens.

As on the Hub, a token belongs to a user, and users may belong to organisations. A caller may
read a public bucket, and a private one only in its own namespace or in one of its
organisations (others get 404; anonymous callers 401); it may write only there, and only with a
write token (read tokens and fine-grained read-only tokens get 403). Hub tokens are configured
at start as ``USER=SECRET:read|write|fine-read``, organisations as ``ORG=USER,USER``. With no
token configured the server is open: every caller is the user ``local`` and may read and write
every namespace (a local scratch server). Xet tokens are HMAC-signed (bucket, scope, expiry)
with a secret kept in the data dir, so they survive restarts like real ones and need no table.
Secrets never appear in reprs or logs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from kvbucket.errors import ConfigError
from kvbucket.secrets import remember

Scope = Literal["read", "write"]
TokenScope = Literal["read", "write", "fine-read"]
TOKEN_SCOPES = ("read", "write", "fine-read")

# The Hub's rule for one part of a repo/bucket id (huggingface_hub's REPO_ID_REGEX and
# validate_repo_id): 1-96 of [A-Za-z0-9_.-], starting and ending with a letter, digit or '_',
# no '--' or '..', not ending in '.git'.
_HUB_NAME_RE = re.compile(r"^(?=[A-Za-z0-9_])[A-Za-z0-9_.-]{1,96}(?<=[A-Za-z0-9_])$")


def hub_name_problem(part: str) -> str | None:
    """Why ``part`` is not a valid Hub namespace or bucket name, or None if it is."""
    if not _HUB_NAME_RE.match(part):
        return "use 1-96 letters, digits, '-', '_' or '.', starting and ending with a letter, a digit or '_'"
    if "--" in part or ".." in part:
        return "'--' and '..' are not allowed"
    if part.endswith(".git"):
        return "a name cannot end in '.git'"
    return None


@dataclass(frozen=True)
class TokenSpec:
    """One configured Hub token of user ``name``. ``secret`` is a SecretStr (never in a repr).

    ``scope``: ``write``, ``read``, or ``fine-read`` (a fine-grained token that may only read
    the user's and its organisations' repos; ``whoami`` reports it as ``fineGrained``).
    """

    name: str
    secret: SecretStr
    scope: TokenScope

    @classmethod
    def parse(cls, spec: str) -> TokenSpec:
        """Parse ``USER=SECRET:read|write|fine-read`` (the CLI form)."""
        name, sep, rest = spec.partition("=")
        secret, sep2, scope = rest.rpartition(":")
        remember(secret)  # masked in every output from now on (kvbucket.secrets)
        if not sep or not sep2 or not name or not secret:
            raise ConfigError("a token is given as USER=SECRET:SCOPE, SCOPE being read, write or fine-read")
        if scope not in TOKEN_SCOPES:
            raise ConfigError(f"token of {name!r}: scope must be read, write or fine-read, not {scope!r}")
        why = hub_name_problem(name)
        if why:
            raise ConfigError(f"token user name {name!r} is not a valid Hub user name: {why}")
        return cls(name, SecretStr(secret), scope)  # type: ignore[arg-type]

    @property
    def display_name(self) -> str:
        return f"{self.name}-{self.scope}"


def parse_org(spec: str) -> tuple[str, list[str]]:
    """Parse ``ORG=USER,USER`` (the CLI form of ``--org``)."""
    org, sep, members = spec.partition("=")
    users = [u.strip() for u in members.split(",") if u.strip()]
    if not sep or not org:
        raise ConfigError(f"an organisation is given as ORG=USER,USER (e.g. acme=alice,bob), not {spec!r}")
    for n in (org, *users):
        why = hub_name_problem(n)
        if why:
            raise ConfigError(f"{n!r} in --org {org}: not a valid Hub name: {why}")
    return org, users


@dataclass(frozen=True)
class Caller:
    """The identity behind a request: a user (with its organisations and token scope),
    anonymous, or anyone on an open server."""

    name: str
    scope: TokenScope | None  # None: anonymous
    orgs: tuple[str, ...] = ()
    open_server: bool = False
    token_name: str = ""

    @property
    def authenticated(self) -> bool:
        return self.scope is not None

    @property
    def can_write(self) -> bool:
        return self.open_server or self.scope == "write"

    def member_of(self, namespace: str) -> bool:
        """May act in ``namespace``: its own, one of its organisations', or any on an open server."""
        return self.open_server or (self.authenticated and (namespace == self.name or namespace in self.orgs))

    def can_read(self, namespace: str, private: bool) -> bool:
        return not private or self.member_of(namespace)


ANONYMOUS = Caller("anonymous", None)
OPEN_USER = "local"


@dataclass
class Auth:
    tokens: list[TokenSpec] = field(default_factory=list)
    xet_ttl_s: int = 3600
    signing_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    orgs: Mapping[str, Iterable[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_secret = {t.secret.get_secret_value(): t for t in self.tokens}
        if len(self._by_secret) != len(self.tokens):
            raise ConfigError("two configured tokens have the same secret: give each token its own")
        self.orgs = {o: tuple(dict.fromkeys(m)) for o, m in self.orgs.items()}
        users = {t.name for t in self.tokens}
        clash = sorted(users & set(self.orgs))
        if clash:
            raise ConfigError(f"{clash[0]!r} is both a user and an organisation: a namespace is one of them")
        self._orgs_of: dict[str, tuple[str, ...]] = {}
        for org, members in self.orgs.items():
            for m in members:
                self._orgs_of[m] = (*self._orgs_of.get(m, ()), org)

    @property
    def open(self) -> bool:
        return not self.tokens

    def namespaces(self) -> set[str]:
        """Every namespace that exists: configured users (token holders and org members) and orgs."""
        if self.open:
            return {OPEN_USER}
        members = {m for ms in self.orgs.values() for m in ms}
        return {t.name for t in self.tokens} | set(self.orgs) | members

    def orgs_of(self, user: str) -> tuple[str, ...]:
        return self._orgs_of.get(user, ())

    @staticmethod
    def load_key(data_dir: Path) -> bytes:
        """The Xet-token signing key, created once per data dir (0600) so tokens survive restarts."""
        path = data_dir / "signing.key"
        if path.exists():
            return path.read_bytes()
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key

    def caller(self, authorization: str | None) -> Caller | None:
        """Resolve a Hub ``Authorization`` header; None means a token was sent but is not valid."""
        token = _bearer(authorization)
        if self.open:
            return Caller(OPEN_USER, "write", open_server=True, token_name="open-server")
        if token is None:
            return ANONYMOUS
        spec = self._by_secret.get(token)
        if spec is None:
            return None
        return Caller(spec.name, spec.scope, self.orgs_of(spec.name), token_name=spec.display_name)

    # -- xet tokens ------------------------------------------------------------------------
    def issue_xet_token(self, bucket_id: str, scope: Scope) -> tuple[str, int]:
        exp = int(time.time()) + self.xet_ttl_s
        body = json.dumps({"b": bucket_id, "s": scope, "e": exp}, separators=(",", ":")).encode()
        return self._sign(body), exp

    def check_xet_token(self, authorization: str | None) -> tuple[str, Scope] | None:
        """(bucket id, scope) of a valid unexpired Xet token, else None."""
        token = _bearer(authorization)
        if token is None:
            return None
        body = self._verify(token)
        if body is None:
            return None
        try:
            claims = json.loads(body)
            if int(claims["e"]) < time.time():
                return None
            return str(claims["b"]), claims["s"]
        except (ValueError, KeyError, TypeError):
            return None

    # -- signed fetch URLs -----------------------------------------------------------------
    def sign_fetch(self, xorb_hex: str, exp: int) -> str:
        return hmac.new(self.signing_key, f"fetch:{xorb_hex}:{exp}".encode(), hashlib.sha256).hexdigest()[:32]

    def check_fetch(self, xorb_hex: str, exp: str, sig: str) -> bool:
        try:
            if int(exp) < time.time():
                return False
        except ValueError:
            return False
        return hmac.compare_digest(self.sign_fetch(xorb_hex, int(exp)), sig)

    def _sign(self, body: bytes) -> str:
        mac = hmac.new(self.signing_key, body, hashlib.sha256).digest()[:20]
        return "xet_" + base64.urlsafe_b64encode(body).decode().rstrip("=") + "." + mac.hex()

    def _verify(self, token: str) -> bytes | None:
        if not token.startswith("xet_") or "." not in token:
            return None
        b64, _, mac_hex = token[4:].rpartition(".")
        try:
            body = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        except ValueError:
            return None
        mac = hmac.new(self.signing_key, body, hashlib.sha256).digest()[:20]
        return body if hmac.compare_digest(mac.hex(), mac_hex) else None


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    kind, _, value = authorization.partition(" ")
    if kind.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
