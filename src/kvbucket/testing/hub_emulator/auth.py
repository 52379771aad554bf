"""Who may do what: Hub tokens configured at start, and short-lived signed Xet tokens.

Hub tokens are ``NAME=SECRET:read|write``. With none configured the server is open (anyone may
read and write, as a local scratch server). Every configured user may see every bucket: the
emulator plays one organisation, which is what tests of private buckets need. Xet tokens are
HMAC-signed (bucket, scope, expiry) with a secret kept in the data dir, so they survive restarts
like real ones and need no table. Secrets never appear in reprs or logs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from kvbucket.errors import ConfigError

Scope = Literal["read", "write"]


@dataclass(frozen=True)
class TokenSpec:
    """One configured Hub token. ``secret`` is a SecretStr so it never shows up in a repr."""

    name: str
    secret: SecretStr
    scope: Scope

    @classmethod
    def parse(cls, spec: str) -> TokenSpec:
        """Parse ``NAME=SECRET:read|write`` (the CLI form)."""
        name, sep, rest = spec.partition("=")
        secret, sep2, scope = rest.rpartition(":")
        if not sep or not sep2 or not name or not secret:
            raise ConfigError("a token is given as NAME=SECRET:read or NAME=SECRET:write")
        if scope not in ("read", "write"):
            raise ConfigError(f"token {name!r}: scope must be 'read' or 'write', not {scope!r}")
        if "/" in name or not name.strip():
            raise ConfigError(f"token name {name!r} must be a plain user name (no '/')")
        return cls(name, SecretStr(secret), scope)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Caller:
    """The identity behind a request."""

    name: str
    can_read: bool
    can_write: bool
    authenticated: bool


ANONYMOUS = Caller("anonymous", can_read=False, can_write=False, authenticated=False)
OPEN_USER = "local"


@dataclass
class Auth:
    tokens: list[TokenSpec] = field(default_factory=list)
    xet_ttl_s: int = 3600
    signing_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        self._by_secret = {t.secret.get_secret_value(): t for t in self.tokens}

    @property
    def open(self) -> bool:
        return not self.tokens

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
            return Caller(OPEN_USER, True, True, token is not None)
        if token is None:
            return ANONYMOUS
        spec = self._by_secret.get(token)
        if spec is None:
            return None
        return Caller(spec.name, True, spec.scope == "write", True)

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
