"""The S3 store (AWS or any S3-compatible server): ``s3://<bucket>[/<prefix>]``.

:mod:`.store` holds :class:`~kvbucket.stores.s3.store.S3Store` (obstore for writes, listings and
deletes), :mod:`.direct` the libcurl GETs straight into callers' buffers, :mod:`.client` the
connections both share, :mod:`.config` the settings. May import :mod:`kvbucket.stores.base`,
:mod:`kvbucket.stores.deadline` and :mod:`kvbucket.stores.guard`; no other store family. Imported
lazily (``open_store``), so ``import kvbucket`` pulls no S3 client.
"""

from __future__ import annotations

import importlib
from typing import Any

# ``from kvbucket.stores.s3 import S3Store`` (this name was one module before stores/ had folders)
# keeps working, without importing the S3 clients for a reader of :mod:`.config` alone.
_LAZY = {"S3Config": "config", "S3Store": "store", "open_s3_store": "store", "store_from_remote_url": "store"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
