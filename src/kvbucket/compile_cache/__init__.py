"""A compile cache on buckets: compile once, never again, on any machine.

``with compile_cache(model_id=..., task=..., export_config=..., target="hf://buckets/org/cache"):``
fetches the compiled entries on enter and publishes the good new ones on exit. Layouts plug in
the compiler's local cache format: ``neuron`` (neuronx-cc), ``torch`` (torch.compile portable
artifacts) and ``directory`` (any cache dir of immutable files: Triton, Inductor, JAX, vLLM).
See docs/compile_cache.md.
"""

from __future__ import annotations

from kvbucket.compile_cache.fetch import fetch
from kvbucket.compile_cache.layout import (
    CacheLayout,
    DirectoryLayout,
    EntryState,
    LocalEntry,
    NeuronLayout,
    TorchLayout,
    get_layout,
)
from kvbucket.compile_cache.lookup import ExportRecord, lookup, normalize_config
from kvbucket.compile_cache.session import CompileCacheSession, compile_cache
from kvbucket.compile_cache.sync import SyncBusyError, sync
from kvbucket.compile_cache.transfer import ModelScope, TransferReport

__all__ = [
    "CacheLayout",
    "CompileCacheSession",
    "DirectoryLayout",
    "EntryState",
    "ExportRecord",
    "LocalEntry",
    "ModelScope",
    "NeuronLayout",
    "SyncBusyError",
    "TorchLayout",
    "TransferReport",
    "compile_cache",
    "fetch",
    "get_layout",
    "lookup",
    "normalize_config",
    "sync",
]
