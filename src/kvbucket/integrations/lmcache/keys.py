"""LMCache's keys and kvbucket's: LMCache 0.5.6's ``ObjectKey`` has an ``object_group_id`` that the
documented object name ``<model>@<kv_rank_hex>@<chunk_hash_hex>[@salt]`` lacks. kvbucket folds it
into the rank as ``kv_rank | object_group_id << 32``, so group 0 (every non-hybrid model) gets
exactly the documented name and other groups never collide with it.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey as LMObjectKey

from kvbucket.keys import ObjectKey

_GROUP_SHIFT = 32


_KEY_CACHE_MAX = 1 << 20
_key_cache: dict[LMObjectKey, ObjectKey] = {}
_lm_key_cache: dict[ObjectKey, LMObjectKey] = {}


def to_kvbucket_key(key: LMObjectKey) -> ObjectKey:
    """kvbucket's key for an LMCache key (memoised: the controllers pass the same keys to
    lookup, load and unlock, and building a validated key is not free)."""
    hit = _key_cache.get(key)
    if hit is not None:
        return hit
    if len(_key_cache) >= _KEY_CACHE_MAX:
        _key_cache.clear()
        _lm_key_cache.clear()
    converted = _key_cache[key] = _convert_key(key)
    _lm_key_cache[converted] = key
    return converted


def _convert_key(key: LMObjectKey) -> ObjectKey:
    group = int(getattr(key, "object_group_id", 0) or 0)
    return ObjectKey(
        key.model_name, int(key.kv_rank) | group << _GROUP_SHIFT, bytes(key.chunk_hash), key.cache_salt
    )


def to_lmcache_key(key: ObjectKey) -> LMObjectKey:
    hit = _lm_key_cache.get(key)
    if hit is not None:
        return hit
    return LMObjectKey(
        chunk_hash=bytes(key.chunk_hash),
        model_name=key.model_name,
        kv_rank=key.kv_rank & ((1 << _GROUP_SHIFT) - 1),
        object_group_id=key.kv_rank >> _GROUP_SHIFT,
        cache_salt=key.cache_salt,
    )

