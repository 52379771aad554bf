"""Stores on this machine: a directory (:mod:`.file`, ``file:///abs/dir`` or a bare path, the
embedded default; :mod:`.paths` maps names to files inside it, never outside) and memory
(:mod:`.memory`, ``memory://``, for tests). May import :mod:`kvbucket.stores.base` and
:mod:`kvbucket.stores.deadline`; no other store family.
"""
