"""The S3 store (AWS or any S3-compatible server): ``s3://<bucket>[/<prefix>]``.

:mod:`.store` holds :class:`~kvbucket.stores.s3.store.S3Store` (obstore for writes, listings and
deletes), :mod:`.direct` the libcurl GETs straight into callers' buffers, :mod:`.client` the
connections both share, :mod:`.config` the settings. May import :mod:`kvbucket.stores.base`,
:mod:`kvbucket.stores.deadline` and :mod:`kvbucket.stores.guard`; no other store family. Imported
lazily (``open_store``), so ``import kvbucket`` pulls no S3 client.
"""
