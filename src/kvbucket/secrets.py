"""Keep secrets out of logs, reprs and exception messages."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

__all__ = ["SecretStr", "redact", "reveal"]


def reveal(value: SecretStr | str | None) -> str | None:
    """Return the plain secret, for handing to a client library only."""
    if value is None:
        return None
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value


def redact(text: str, *secrets: Any) -> str:
    """Replace every occurrence of each non-empty secret in ``text`` with ``***``."""
    for s in secrets:
        plain = reveal(s) if isinstance(s, SecretStr | str) else None
        if plain and len(plain) >= 4:
            text = text.replace(plain, "***")
    return text
