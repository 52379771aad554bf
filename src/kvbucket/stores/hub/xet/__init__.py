"""Xet, the Hub's content-addressed storage, as the Hub store reads and writes it.

:mod:`.reads` fetches reconstructions (ranged GETs of xorbs) into callers' buffers, :mod:`.decode`
and :mod:`.kernel` (the compiled decoder) turn chunks back into bytes off the GIL, :mod:`.uploads`
and :mod:`.compression` hand objects to ``hf_xet`` and choose how they compress, :mod:`.sessions`
and :mod:`.tokens` hold the CAS connections and access tokens. Used only by
:mod:`kvbucket.stores.hub`; imports :mod:`kvbucket.stores.base` and :mod:`kvbucket.stores.deadline`.
"""
