"""Test helpers users can import too: servers that stand in for the real thing.

``HubEmulator`` is a local Hugging Face Storage Buckets server; ``kvbucket.testing.hub_fixtures``
holds pytest fixtures around it.
"""

from __future__ import annotations

from .hub_emulator import FaultControl, HubEmulator, TokenSpec

__all__ = ["FaultControl", "HubEmulator", "TokenSpec"]
