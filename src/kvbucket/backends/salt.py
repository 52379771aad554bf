"""Which salt a storage backend's chunk belongs to, as the fleet counts it (per-salt fair shares,
``pinned_salts``). Apart from :mod:`kvbucket.backends.fleet` so ``kvbucket du``
(:func:`kvbucket.fleet.report.inspect_fleet`) reads backend names without importing fleet code back.

Chunk names are kvbucket's encodings of :class:`~kvbucket.keys.CacheEngineKey` strings; the salt
is the key's ``cache_salt`` request tag (LMCache's ``lmcache.tag.cache_salt``, written
``model@ws@worker@hash@dtype@cache_salt%tenant``), ``""`` without one.
"""

from __future__ import annotations

from kvbucket.errors import InvalidKeyError
from kvbucket.keys import CacheEngineKey, name_to_key

#: The request config of a CacheEngineKey that is the fleet's salt of its chunk.
SALT_CONFIG = "cache_salt"


def chunk_salt(name: str, prefix: str = "") -> str | None:
    """The fleet's salt of a remote tier's chunk name (``""`` unsalted), None for other objects."""
    try:
        key = CacheEngineKey.from_string(name_to_key(name, prefix))
    except InvalidKeyError:
        return None
    return (key.request_configs or {}).get(SALT_CONFIG, "")


__all__ = ["SALT_CONFIG", "chunk_salt"]
