"""Object stores behind one protocol, chosen by URL.

``open_store(url)`` picks the implementation from the URL scheme:

- ``memory://[name]``: :class:`MemoryStore` (tests)
- ``file:///abs/dir`` or a bare path: ``FileStore`` (the embedded default)
- ``hf://buckets/<namespace>/<bucket>[/<prefix>]``: ``HFBucketStore``
- ``s3://<bucket>[/<prefix>]``: ``S3Store``
- ``<namespace>/<bucket>[/<prefix>]``: a Hub bucket id, as ``hf buckets`` takes it (the rule
  that tells it from a relative path: :mod:`kvbucket.stores.urls`)

Backends register themselves in ``_OPENERS`` lazily so that importing kvbucket does not import
every client library.

The layout: :mod:`.base` (the protocol), :mod:`.deadline` and :mod:`.urls` here; one folder per
store family (:mod:`.hub`, :mod:`.s3`, :mod:`.local`) and :mod:`.guard`, the read path every
family's reads go through (sealing and checks, the refusal rule, read-ahead, the breaker). The
store classes users name are importable from here (``from kvbucket.stores import S3Store``),
each imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvbucket.errors import ConfigError
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, check_name
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.stores.urls import resolve_store_url

if TYPE_CHECKING:  # what type checkers see of the lazy names below
    from kvbucket.stores.guard.sealed import SealedStore as SealedStore
    from kvbucket.stores.guard.sealed import seal_store as seal_store
    from kvbucket.stores.hub.config import HFBucketConfig as HFBucketConfig
    from kvbucket.stores.hub.store import HFBucketStore as HFBucketStore
    from kvbucket.stores.local.file import FileStore as FileStore
    from kvbucket.stores.s3.config import S3Config as S3Config
    from kvbucket.stores.s3.store import S3Store as S3Store

# scheme -> "module:function" taking (url, **options) and returning an ObjectStore
_OPENERS: dict[str, str] = {
    "memory": "kvbucket.stores.local.memory:MemoryStore",
    "file": "kvbucket.stores.local.open_file:open_file_store",
    "hf": "kvbucket.stores.hub.open:open_hfbucket_store",
    "s3": "kvbucket.stores.s3.store:open_s3_store",
}

# name -> "module:attr": the public classes, importable from kvbucket.stores without importing
# every family's client library at ``import kvbucket.stores`` (PEP 562 module __getattr__).
_LAZY: dict[str, str] = {
    "FileStore": "kvbucket.stores.local.file:FileStore",
    "HFBucketConfig": "kvbucket.stores.hub.config:HFBucketConfig",
    "HFBucketStore": "kvbucket.stores.hub.store:HFBucketStore",
    "S3Config": "kvbucket.stores.s3.config:S3Config",
    "S3Store": "kvbucket.stores.s3.store:S3Store",
    "SealedStore": "kvbucket.stores.guard.sealed:SealedStore",
    "seal_store": "kvbucket.stores.guard.sealed:seal_store",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def store_scheme(url: str) -> str:
    """The scheme of a store URL (``file`` for a path, ``hf`` for a bucket id); ConfigError for one
    no store opens."""
    if not isinstance(url, str) or not url:
        raise ConfigError("a store URL is required, e.g. file:///var/cache/kvbucket or hf://buckets/org/name")
    scheme, sep, _ = resolve_store_url(url).partition("://")
    if not sep:
        return "file"
    if scheme not in _OPENERS:
        known = ", ".join(f"{s}://" for s in _OPENERS)
        raise ConfigError(f"unknown store URL scheme {scheme!r} in {url!r}; use one of {known} or a path")
    return scheme


def open_store(url: str, **options: Any) -> ObjectStore:
    """Open the object store a URL (or a Hub bucket id) names. Unknown schemes get an error listing
    the known ones."""
    url = resolve_store_url(url)
    scheme = store_scheme(url)
    if scheme == "memory":
        return MemoryStore(url.partition("://")[2])
    if scheme == "hf":  # before huggingface_hub's import reads $HF_ENDPOINT
        from kvbucket.stores.hub.config import check_hf_endpoint_env

        check_hf_endpoint_env()
    target = _OPENERS[scheme]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # pragma: no cover - depends on installed extras
        raise ConfigError(f"the {scheme}:// store is not available: {e}") from e
    return getattr(module, attr)(url, **options)


# The lazy names are left out, so that ``from kvbucket.stores import *`` imports no store client.
__all__ = ["Buffer", "ItemResult", "MemoryStore", "ObjectInfo", "ObjectStore", "check_name", "open_store",
           "resolve_store_url", "store_scheme"]
