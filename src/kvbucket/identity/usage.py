"""What a store holds per model and identity (``kvbucket du``), and one generation's names
(``kvbucket rm --model NAME --identity ID``).

A chunk's model and identity are read from its name alone (a listing, no reads):

- kvbucket's key names (L2 adapter, connector, remote tier, transformers): the last segment is a
  key string ``<model>[~<token>]@...``;
- engine tiers' names (vLLM, SGLang): ``<prefix>/<model segment>[~<token>]/<salt>/...``.

A name without a token is ``name only`` (written before identities, or by a process without
one). Manifests (``_identity/``), fleet objects (``_fleet/``) and names of other formats are not
chunks of any model. Old identities are garbage, not data: ``du`` shows each generation's size and
last write, so the ones no deployment uses any more can be removed by ``rm --identity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvbucket.errors import InvalidKeyError
from kvbucket.identity.core import split
from kvbucket.identity.manifest import DIR, parse_manifest_name
from kvbucket.keys import decode_key

NAME_ONLY = "none"  # what `rm --identity` takes for chunks written without an identity


@dataclass
class Generation:
    """The chunks of one model and identity (``token`` None: name only)."""

    model: str
    token: str | None
    chunks: int = 0
    bytes: int = 0
    last_write: float | None = None
    weights: str | None = None  # from the identity's manifest, when it has one

    def add(self, size: int, mtime: float | None) -> None:
        self.chunks += 1
        self.bytes += size
        if mtime is not None and (self.last_write is None or mtime > self.last_write):
            self.last_write = mtime

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "identity": self.token or NAME_ONLY, "chunks": self.chunks,
                "bytes": self.bytes, "last_write": self.last_write, "weights": self.weights}


def model_and_token(name: str) -> tuple[str, str | None] | None:
    """``(model, token)`` a chunk name carries (see the module docstring), else None."""
    parts = name.split("/")
    if any(p in (DIR, "_fleet") for p in parts):
        return None
    try:
        key = decode_key(parts[-1])
    except InvalidKeyError:
        key = ""
    if "@" in key:
        return split(key.partition("@")[0])
    if len(parts) >= 5 and (parts[2] == "nosalt" or parts[2].startswith("salt-")):
        return split(parts[1])
    return None


class Generations:
    """A listing (:class:`~kvbucket.stores.base.ObjectInfo`) grouped by model and identity, fed
    one entry at a time (``du`` counts its totals from the same pass)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str | None], Generation] = {}

    def add(self, info: Any) -> None:
        found = model_and_token(info.name)
        if found is None:
            return
        g = self._groups.get(found)
        if g is None:
            g = self._groups[found] = Generation(*found)
        g.add(info.size, info.mtime)

    def sorted(self) -> list[Generation]:
        """Largest first."""
        return sorted(self._groups.values(), key=lambda g: (-g.bytes, g.model, g.token or ""))


def generations(infos: Iterable[Any]) -> list[Generation]:
    """Group a listing by model and identity, largest first."""
    gens = Generations()
    for info in infos:
        gens.add(info)
    return gens.sorted()


def _manifest_of(name: str) -> tuple[str, str] | None:
    parts = name.split("/")
    if DIR not in parts:
        return None
    at = parts.index(DIR)
    return parse_manifest_name("/".join(parts[at:]))


def select(infos: Iterable[Any], model: str, token: str) -> Iterator[Any]:
    """The listed chunks (and the identity's manifest entry) of one model and identity;
    ``token`` ``"none"``: its name-only chunks. ``model`` is the model as ``du`` shows it."""
    want = None if token == NAME_ONLY else token
    for info in infos:
        manifest = _manifest_of(info.name)
        if manifest is not None:
            if want is not None and manifest == (model, want):
                yield info
            continue
        if model_and_token(info.name) == (model, want):
            yield info


__all__ = ["NAME_ONLY", "Generation", "Generations", "generations", "model_and_token", "select"]
