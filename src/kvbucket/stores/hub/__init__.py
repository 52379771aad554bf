"""The Hugging Face Storage Buckets store: ``hf://buckets/<namespace>/<bucket>[/<prefix>]``.

:mod:`.store` holds :class:`~kvbucket.stores.hub.store.HFBucketStore` (the protocol's verbs over
the Hub's bucket API); :mod:`.client` speaks to the Hub (listings, batch commits, metadata) and
hands bytes to :mod:`.xet` (content-addressed reads and uploads, the Hub's CAS); :mod:`.config`,
:mod:`.open` (the ``hf://`` opener), :mod:`.errors` (Hub answers as :mod:`kvbucket.errors`),
:mod:`.files` and :mod:`.meta_cache` are its parts. May import :mod:`kvbucket.stores.base`,
:mod:`kvbucket.stores.deadline`, :mod:`kvbucket.stores.urls` and :mod:`kvbucket.stores.guard`; no
other store family. Imported lazily (``open_store``), so ``import kvbucket`` pulls no Hub client.
"""
