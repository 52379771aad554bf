"""The "did you mean" of every error about a name the user typed: a config key at any level, an
enumerated option's value, a ``KVBUCKET_*`` environment variable. One rule (difflib's ratio at
0.6, the closest one), so every message suggests alike.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

CUTOFF = 0.6


def closest(word: object, choices: Iterable[str], cutoff: float = CUTOFF) -> str | None:
    """The choice closest to ``word`` (case-insensitive), or None when none is close."""
    if not isinstance(word, str) or not word:
        return None
    options = [c for c in choices if isinstance(c, str)]
    by_lower = {c.lower(): c for c in options}
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[found[0]] if found and by_lower[found[0]] != word else None


def did_you_mean(word: object, choices: Iterable[str], cutoff: float = CUTOFF) -> str:
    """``"did you mean 'x'? "`` (with its trailing space, to put before the list of choices), or ``""``."""
    close = closest(word, choices, cutoff)
    return f"did you mean {close!r}? " if close else ""


def with_hints(words: Iterable[str], choices: Iterable[str]) -> str:
    """``"'a' (did you mean 'b'?), 'c'"``: each word, with its suggestion when one is close."""
    options = list(choices)
    out = []
    for w in words:
        close = closest(w, options)
        out.append(f"{w!r} (did you mean {close!r}?)" if close else repr(w))
    return ", ".join(out)


def _model_of(annotation: Any) -> Any:
    """The pydantic model class an annotation holds (``Model``, ``Model | None``), else None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def keys_at(model: Any, loc: Sequence[Any]) -> list[str]:
    """The keys a pydantic model takes at the level of ``loc`` (a validation error's location, its
    last element the key in question): its fields and their aliases, nested models followed."""
    current = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            continue  # a list index or a dict key: the same model goes on
        current = _model_of(fields[part].annotation)
        if current is None:
            return []
    fields = getattr(current, "model_fields", None) or {}
    return [*fields, *(f.alias for f in fields.values() if f.alias)]


def unknown_key_hint(model: Any, loc: Sequence[Any]) -> str:
    """``did_you_mean`` for the unknown key at the end of ``loc`` among the keys of that level."""
    return did_you_mean(loc[-1] if loc else None, keys_at(model, loc)) if model is not None else ""


def value_hint(err: dict[str, Any]) -> str:
    """For a pydantic error on an enumerated value (a Literal or Enum): did you mean one of them?"""
    if err.get("type") not in ("literal_error", "enum"):
        return ""
    expected = str((err.get("ctx") or {}).get("expected", ""))
    choices = [c.strip().strip("'\"") for c in expected.replace(" or ", ",").split(",") if c.strip()]
    return did_you_mean(err.get("input"), choices)


__all__ = ["CUTOFF", "closest", "did_you_mean", "keys_at", "unknown_key_hint", "value_hint", "with_hints"]
