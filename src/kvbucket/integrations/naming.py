"""Object-name segments shared by the engine integrations (SGLang, vLLM)."""

from __future__ import annotations

import hashlib


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
