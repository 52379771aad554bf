"""``python -m kvbucket.testing.hub_emulator``: the child side of ``HubEmulator(subprocess=True)``."""

from __future__ import annotations

from .server import child_main

if __name__ == "__main__":
    child_main()
