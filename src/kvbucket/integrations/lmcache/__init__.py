"""kvbucket inside the real LMCache (``pip install kvbucket[lmcache]``; tested with 0.5.6).

Two entry points, both loaded by LMCache from this module path:

- :class:`KVBucketL2Adapter`, an MP-mode L2 adapter (``lmcache server`` / ``lmcache bench l2``)::

      --l2-adapter '{"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                     "class_name": "KVBucketL2Adapter",
                     "adapter_params": {"type": "hfbucket", "bucket_handle": "hf://buckets/org/kv"}}'

  ``adapter_params`` is exactly a kvbucket adapter spec (types ``hfbucket``, ``s3``, ``fs``; see
  :mod:`kvbucket.l2.config`), parsed strictly. The adapter delegates to
  :class:`kvbucket.l2.ObjectStoreL2Adapter` and reports stored/accessed/deleted keys to
  LMCache's listeners, so LMCache's own eviction controller (the plugin spec's top-level
  ``"eviction"``) also works; use either that or kvbucket's (``adapter_params.eviction``).

- :class:`KVBucketConnector`, a non-MP remote connector loaded through ``remote_storage_plugins``
  with ``remote_storage_plugin.<name>.module_path: kvbucket.integrations.lmcache`` and
  ``.class_name: KVBucketConnector``, configured by seed 001's ``remote_storage_plugin.<name>.*``
  keys. ``bucket_handle`` may be ``hf://buckets/...``, ``s3://bucket[/prefix]`` (plus the s3
  keys of the ``s3`` adapter type) or ``file:///dir``.

Key mapping: LMCache 0.5.6's ``ObjectKey`` has an ``object_group_id`` that the documented object
name ``<model>@<kv_rank_hex>@<chunk_hash_hex>[@salt]`` lacks. kvbucket folds it into the rank as
``kv_rank | object_group_id << 32``, so group 0 (every non-hybrid model) gets exactly the
documented name and other groups never collide with it.

Importing this package needs lmcache; importing ``kvbucket`` does not. Its modules: ``keys`` (the
key mapping), ``l2_adapter`` (MP mode), ``connector`` (non-MP); LMCache configs name this package.
"""


from __future__ import annotations

from kvbucket.integrations.lmcache.connector import KVBucketConnector, connector_config_from_extra
from kvbucket.integrations.lmcache.keys import to_kvbucket_key, to_lmcache_key
from kvbucket.integrations.lmcache.l2_adapter import KVBucketL2Adapter

__all__ = [
    "KVBucketConnector",
    "KVBucketL2Adapter",
    "connector_config_from_extra",
    "to_kvbucket_key",
    "to_lmcache_key",
]
