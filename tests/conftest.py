"""Shared fixtures. Servers used by tests are started by fixtures on 127.0.0.1 and stopped at the end.

Server fixtures live in ``kvbucket.testing`` modules (users can load them too) and are enabled
here, one line each.
"""

from __future__ import annotations

pytest_plugins: list[str] = [
    "kvbucket.testing.hub_fixtures",
]
