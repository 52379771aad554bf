"""Capability-gated conformance tests, deselected (not skipped) where they do not apply.

A conformance class (``StoreTests``, ``BackendTests``) declares capabilities as class
attributes (``supports_reopen``, ``bounded``...). A test that only makes sense for one value is
decorated with :func:`requires`; loading this module as a pytest plugin
(``pytest_plugins = ["kvbucket.testing.capabilities"]``) deselects it for implementations that
do not declare that value, so a run reports "N deselected" rather than skips that could hide a
missing feature. Without the plugin the test itself still skips with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__kvbucket_requires__"


def requires(capability: str, value: bool = True) -> Callable[[F], F]:
    """Mark a conformance test as applying only where ``cls.<capability> == value``."""

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, (capability, value))
        return fn

    return mark


def applies(cls: type | None, fn: Callable[..., Any]) -> bool:
    need = getattr(fn, _ATTR, None)
    return need is None or cls is None or bool(getattr(cls, need[0], False)) == need[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        fn = getattr(item, "function", None)
        (keep if fn is None or applies(getattr(item, "cls", None), fn) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
