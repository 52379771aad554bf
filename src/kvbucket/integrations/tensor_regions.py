"""The contiguous byte regions of a strided CPU tensor view, as memoryviews into its storage.

An engine's host KV pool hands out a page as a strided view (SGLang's ``layer_first`` page is
2 x layers regions of ``page_size x heads x head_dim``). Writing those regions with one
``writev`` and reading into them with one ``readv`` moves a page between the pool and a file
with no staging copy (:class:`kvbucket.stores.base.Gather` / ``Scatter``).
"""

from __future__ import annotations

from typing import Any

#: More regions than this per page: a staging copy is cheaper than that many tiny I/O vectors
#: (and ``readv``/``writev`` take at most 1024, the envelope header included).
MAX_REGIONS = 512


class StorageViews:
    """Flat byte views of tensor storages, made once per storage (a pool's buffer is one)."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}

    def of(self, t: Any) -> memoryview:
        import torch

        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        view = self._views.get(key)
        if view is None:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            view = self._views[key] = memoryview(flat.numpy())
        return view

    def regions(self, t: Any, max_regions: int = MAX_REGIONS) -> list[memoryview] | None:
        """``t``'s bytes in C order as contiguous regions of its storage; None when ``t`` is not
        on the CPU or needs more than ``max_regions`` regions (the caller copies instead)."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        shape, stride = list(t.shape), list(t.stride())
        k, run = len(shape), 1
        while k and (shape[k - 1] == 1 or stride[k - 1] == run):  # the contiguous innermost dims
            run *= shape[k - 1]
            k -= 1
        count = 1
        for d in range(k):
            count *= shape[d]
        if count > max_regions:
            return None
        offsets = [t.storage_offset()]
        for d in range(k):
            offsets = [o + i * stride[d] for o in offsets for i in range(shape[d])]
        base = self.of(t)
        item = t.element_size()
        nbytes = run * item
        return [base[o * item : o * item + nbytes] for o in offsets]


__all__ = ["MAX_REGIONS", "StorageViews"]
