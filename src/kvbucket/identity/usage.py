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

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvbucket.errors import InvalidKeyError
from kvbucket.identity.core import split
from kvbucket.identity.manifest import DIR, parse_manifest_name
from kvbucket.keys import decode_key

log = logging.getLogger("kvbucket.identity")

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
    fields: dict[str, Any] | None = None  # the manifest's config and KV fields
    first_write: float | None = None  # the manifest's: when its first writer stored a chunk
    host: str | None = None  # the manifest's: that writer's host name
    manifest: str = "missing"  # "ok", "missing" or "unreadable" (an object there, not a manifest)

    def add(self, size: int, mtime: float | None) -> None:
        self.chunks += 1
        self.bytes += size
        if mtime is not None and (self.last_write is None or mtime > self.last_write):
            self.last_write = mtime

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "identity": self.token or NAME_ONLY, "chunks": self.chunks,
                "bytes": self.bytes, "last_write": self.last_write, "weights": self.weights,
                "fields": self.fields, "first_write": self.first_write, "host": self.host,
                "manifest": self.manifest if self.token is not None else None}

    def fields_summary(self, width: int = 6) -> str:
        """``N config fields: a=1, b=2, ...`` (the first ``width`` by name), for the table."""
        if not self.fields:
            return "no config fields recorded"
        shown = ", ".join(f"{k}={_short(v)}" for k, v in sorted(self.fields.items())[:width])
        more = ", ..." if len(self.fields) > width else ""
        return f"{len(self.fields)} config fields: {shown}{more}"

    def take_manifest(self, body: dict[str, Any]) -> None:
        """Fill the manifest's parts (a body that is not an object, or lacks one, leaves it None)."""
        weights, fields = body.get("weights"), body.get("fields")
        self.weights = weights if isinstance(weights, str) else None
        self.fields = fields if isinstance(fields, dict) else None
        first, host = body.get("first_write"), body.get("host")
        self.first_write = float(first) if isinstance(first, int | float) else None
        self.host = host if isinstance(host, str) else None


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        self._manifests: dict[tuple[str, str], str] = {}  # (model, token) -> manifest object name

    def add(self, info: Any) -> None:
        found = model_and_token(info.name)
        if found is None:
            manifest = _manifest_of(info.name)
            if manifest is not None:  # an identity is known by its manifest even without chunks
                self._manifests[manifest] = info.name
                self._groups.setdefault(manifest, Generation(*manifest))
            return
        g = self._groups.get(found)
        if g is None:
            g = self._groups[found] = Generation(*found)
        g.add(info.size, info.mtime)

    def read_manifests(self, store: Any) -> None:
        """Fill each generation's weights and fields from its manifest (one small read each). A
        manifest that cannot be read or parsed leaves them None (``du`` still counts the chunks)."""
        for found, name in sorted(self._manifests.items()):
            g = self._groups[found]
            try:
                raw = store.get(name)
                body = json.loads(raw) if raw else {}
            except Exception as e:  # a damaged or vanished manifest: the chunks still count
                log.debug("cannot read the identity manifest %s: %s", name, e)
                g.manifest = "unreadable"
                continue
            if isinstance(body, dict):
                g.take_manifest(body)
                g.manifest = "ok"
            else:
                g.manifest = "unreadable"

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


MIN_PREFIX = 4  # hex digits: `rm --identity` never removes a generation picked by one or two


class NoSuchIdentity(LookupError):
    """``rm --identity``: nothing, or more than one identity, matches what was given."""


def describe_identities(gens: list[Generation], limit: int = 12) -> str:
    """``model token (N chunks), ...`` for an error line (the first ``limit``)."""
    if not gens:
        return "there are no KV chunks of any model there"
    parts = [f"{g.model} {g.token or NAME_ONLY + ' (name only)'} ({g.chunks} chunk{'s' * (g.chunks != 1)})"
             for g in gens[:limit]]
    more = f" and {len(gens) - limit} more" if len(gens) > limit else ""
    return "the identities there: " + ", ".join(parts) + more


def match_identity(gens: list[Generation], model: str, given: str) -> str:
    """The one token of ``model`` that ``given`` (a token, a unique prefix of one of at least
    :data:`MIN_PREFIX` hex digits, or ``none``) names among ``gens``; else :class:`NoSuchIdentity`
    naming the identities that exist."""
    mine = [g for g in gens if g.model == model]
    if given == NAME_ONLY:
        found = [g for g in mine if g.token is None]
    elif len(given) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in given):
        raise NoSuchIdentity(
            f"--identity {given!r} is not an identity token: give the 16 hex digits `kvbucket du` shows "
            f"(or a unique prefix of at least {MIN_PREFIX}), or `none` for name-only chunks; "
            + describe_identities(mine or gens))
    else:
        found = [g for g in mine if g.token is not None and g.token.startswith(given)]
    if len(found) == 1:
        return found[0].token or NAME_ONLY
    if found:
        raise NoSuchIdentity(f"--identity {given!r} is ambiguous for model {model!r}: it begins "
                             + " and ".join(g.token or NAME_ONLY for g in found) + "; give more digits")
    what = (f"model {model!r} has no chunks or identities here" if not mine
            else f"no identity of model {model!r} matches {given!r}")
    raise NoSuchIdentity(f"{what}; nothing removed; " + describe_identities(mine or gens))


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


__all__ = ["MIN_PREFIX", "NAME_ONLY", "Generation", "Generations", "NoSuchIdentity", "describe_identities",
           "generations", "match_identity", "model_and_token", "select"]
