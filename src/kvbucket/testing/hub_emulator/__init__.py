"""A local Hugging Face Storage Buckets server (Hub REST + Xet CAS) for tests, demos and offline work.

The unmodified ``huggingface_hub`` and ``hf_xet`` clients, pointed at ``HubEmulator.endpoint``,
work against it as against the Hub. See docs/emulator.md.
"""

from __future__ import annotations

from .auth import TokenSpec
from .faults import ROUTES, FaultRule
from .server import FaultControl, HubEmulator

__all__ = ["ROUTES", "FaultControl", "FaultRule", "HubEmulator", "TokenSpec"]
