"""Object-name segments shared by the engine integrations (SGLang, vLLM)."""

from __future__ import annotations

import hashlib
import re

# <prefix>/<model>/<salt>/ then at least two more segments (SGLang: shard/layout/page hash;
# vLLM: <parallel>-<digest>/<block hash>-g<group>); "_fleet/..." never matches.
_NAME_RE = re.compile(r"^[^/]+/[^/]+/(nosalt|salt-[0-9a-f]{24})/[^/]+/[^/].*$")


def path_segment(text: str) -> str:
    """One safe path segment from free text (model names hold ``/`` and other characters)."""
    out = "".join(c if c.isalnum() or c in "-_.+=" else "-" for c in text.replace("/", "--"))
    return out.strip(".") or "_"


def salt_segment(cache_salt: str, engine: str) -> str:
    """The salt part of an object name: a digest, so a secret salt never appears in the bucket.

    ``engine`` separates the digests of the integrations (the same salt on SGLang and vLLM names
    other objects, which hold other bytes anyway).
    """
    if not cache_salt:
        return "nosalt"
    domain = f"kvbucket-{engine}-salt\0".encode()
    return "salt-" + hashlib.sha256(domain + cache_salt.encode()).hexdigest()[:24]


def chunk_salt(name: str) -> str | None:
    """The salt segment of an SGLang page or vLLM chunk name ("" unsalted), None for other names.

    The fleet counts both engines' objects by it (``kvbucket.integrations.engine_fleet``), and
    ``kvbucket du`` reads it through ``kvbucket.fleet``: it lives here, with the names, so the
    fleet does not import the engine tiers' fleet wiring (which imports the fleet).
    """
    m = _NAME_RE.match(name)
    if m is None:
        return None
    seg = m.group(1)
    return "" if seg == "nosalt" else seg
