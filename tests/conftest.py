"""Shared fixtures. Servers used by tests are started here on 127.0.0.1 and stopped at the end."""

from __future__ import annotations
