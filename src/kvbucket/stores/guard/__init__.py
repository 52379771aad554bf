"""The read path every store shares, whatever family serves the bytes.

:mod:`.sealed` seals what persistent tiers write and checks every object read before a caller gets
a byte (:mod:`.envelope_open` opens envelopes, :mod:`.decrypting_reads` decrypts directory reads,
:mod:`.refusals` is the one rule of what a reader may delete); :mod:`.read_ahead` (and its settings,
:mod:`.read_ahead_config`) starts a load at the lookup's hit; :mod:`.breaker` stops calling a store
that is down. Imports :mod:`kvbucket.stores.base`, :mod:`kvbucket.stores.deadline` and modules
outside ``stores/``; never a store family (``hub``, ``s3``, ``local``), which is what lets every
family import it.
"""
