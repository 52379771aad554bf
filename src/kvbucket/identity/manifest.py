"""kvbucket's manifest of the identities that wrote under a model's namespace.

``<prefix>/_identity/<model>/<token>``: one small JSON object per identity (model, token, what
the weights are, the config fields), written once by the first process of that identity to store
a chunk there (a put-if-missing: nothing is ever overwritten or deleted by a reader). A process
whose identity is not among them logs once which identities it saw and what to set to reuse
theirs (their chunks are another model's to it: misses, nothing deleted). The manifest is plain
JSON (names and digests, never prompts), outside any chunk listing (``is_manifest_name``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from kvbucket.identity.core import IdentityPending, ModelIdentity, is_token, qualify, split
from kvbucket.keys import decode_key, encode_key

log = logging.getLogger("kvbucket.identity")

DIR = "_identity"


def manifest_dir(prefix: str, model: str) -> str:
    return "/".join(p for p in (prefix, DIR, encode_key(model)) if p)


def manifest_name(prefix: str, model: str, token: str) -> str:
    return f"{manifest_dir(prefix, model)}/{token}"


def is_manifest_name(name: str, prefix: str = "") -> bool:
    rel = name[len(prefix) + 1:] if prefix and name.startswith(prefix + "/") else name
    return rel.startswith(DIR + "/")


def parse_manifest_name(name: str, prefix: str = "") -> tuple[str, str] | None:
    """``(model, token)`` of a manifest object name, else None."""
    rel = name[len(prefix) + 1:] if prefix and name.startswith(prefix + "/") else name
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != DIR or not is_token(parts[2]):
        return None
    try:
        return decode_key(parts[1]), parts[2]
    except Exception:
        return None


def read_identities(store: Any, prefix: str, model: str) -> dict[str, dict[str, Any]]:
    """The identities recorded for ``model`` under ``prefix``: token -> its manifest (or {})."""
    out: dict[str, dict[str, Any]] = {}
    for info in store.list(manifest_dir(prefix, model) + "/"):
        parsed = parse_manifest_name(info.name, prefix)
        if parsed is None:
            continue
        try:
            body = store.get(info.name)
            manifest = json.loads(body) if body else {}
        except Exception as e:  # listed but not read (gone since, the store closing): say so
            manifest = {UNREADABLE: f"{type(e).__name__}: {e}"}
        out[parsed[1]] = manifest if isinstance(manifest, dict) else {UNREADABLE: "not a JSON object"}
    return out


UNREADABLE = "_unreadable"  # read_identities' mark of a manifest listed but not readable as one


def describe(manifest: dict[str, Any]) -> str:
    """A manifest's weights for a log line: its text, or why it is not known."""
    weights = manifest.get("weights")
    if isinstance(weights, str) and weights:
        return weights
    return "manifest unreadable" if UNREADABLE in manifest else "weights unknown"


class Manifest:
    """One process's view of one namespace's manifest (see the module docstring).

    ``store`` is the raw store (not sealed: readers of every identity read it). :meth:`check`
    runs once, in the background; :meth:`record` once, after the first chunk this process stored.
    """

    def __init__(self, store: Any, prefix: str, identity: ModelIdentity, where: str,
                 model_key: str | None = None) -> None:
        """``model_key``: the model as the names spell it (engine tiers: its path segment),
        default the identity's model name."""
        self.store, self.prefix, self.identity, self.where = store, prefix, identity, where
        self.model_key = model_key or identity.model
        self._recorded = False
        self._recording: threading.Thread | None = None
        self._lock = threading.Lock()
        self.seen: dict[str, dict[str, Any]] | None = None
        self.checked = threading.Event()  # set when check() is done

    def start(self) -> None:
        threading.Thread(target=self.check, name="kvbucket-identity-check", daemon=True).start()

    def check(self) -> dict[str, dict[str, Any]]:
        """Read the namespace's identities; log once when this one is not among them."""
        try:
            seen = read_identities(self.store, self.prefix, self.model_key)
        except Exception as e:
            log.debug("%s: cannot read the identity manifest: %s", self.where, e)
            seen = {}
        try:
            self._tell(seen)
        finally:
            self.seen = seen
            self.checked.set()
        return seen

    def _tell(self, seen: dict[str, dict[str, Any]]) -> None:
        token = self.identity.token
        if seen and token not in seen:
            others = ", ".join(f"{t} ({describe(m)})" for t, m in sorted(seen.items()))
            log.warning(
                "%s: the chunks stored for model %r were written by other identities: %s. This process "
                "is %s (%s), so it treats them as another model's: misses, nothing deleted. If the "
                "model is really the same, set model_identity to one of those tokens to reuse them.",
                self.where, self.identity.model, others, token, self.identity.weights or "weights unknown")

    def record(self) -> None:
        """Write this identity's manifest entry once (after a chunk landed), unless it exists."""
        with self._lock:
            if self._recorded:
                return
            self._recorded = True
        name = manifest_name(self.prefix, self.model_key, self.identity.token)
        try:
            if self.store.head(name) is None:
                body = {**self.identity.manifest(), "first_write": time.time(), "host": socket.gethostname()}
                self.store.put(name, json.dumps(body, sort_keys=True, default=str).encode())
        except Exception as e:
            log.debug("%s: cannot write the identity manifest: %s", self.where, e)
            with self._lock:
                self._recorded = False

    def record_async(self) -> None:
        if not self._recorded:
            t = self._recording = threading.Thread(target=self.record, name="kvbucket-identity-record",
                                                   daemon=True)
            t.start()

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for a write begun by :meth:`record_async`: before the
        store closes, so a short-lived writer still leaves its manifest."""
        t = self._recording
        if t is not None:
            t.join(timeout)


__all__ = ["DIR", "Manifest", "ManifestBook", "is_manifest_name", "manifest_dir", "manifest_name",
           "parse_manifest_name", "read_identities"]


class ManifestBook:
    """The manifests of every model one adapter, connector or tier serves (it learns models from
    keys): each is checked once when the model is first seen, and recorded once when first
    written. Identities come from ``setting`` (an :class:`~kvbucket.identity.core.IdentitySetting`:
    keys carry the bare model name) or from :meth:`add` (keys already carry ``<model>~<token>``,
    as the transformers cache names them)."""

    def __init__(self, store: Any, prefix: str, setting: Any, where: str) -> None:
        self.store, self.prefix, self.setting, self.where = store, prefix, setting, where
        self._manifests: dict[str, Manifest] = {}
        self._given: dict[str, ModelIdentity] = {}  # "<model>~<token>" -> its identity (add)
        self._lock = threading.Lock()

    def add(self, identity: ModelIdentity) -> None:
        """Keys whose model part is ``<identity.model>~<identity.token>`` are this identity's."""
        with self._lock:
            self._given[qualify(identity.model, identity.token)] = identity
        self._get(qualify(identity.model, identity.token))

    def _identity(self, model: str) -> ModelIdentity | None:
        if split(model)[1] is not None:
            return self._given.get(model)
        return self.setting.identity(model) if self.setting else None

    def _get(self, model: str) -> Manifest | None:
        m = self._manifests.get(model)
        if m is not None:
            return m
        try:
            identity = self._identity(model)
        except IdentityPending:  # not known yet: checked when it is
            return None
        if identity is None:
            return None
        with self._lock:
            m = self._manifests.get(model)
            if m is None:
                m = self._manifests[model] = Manifest(self.store, self.prefix, identity, self.where)
                m.start()
        return m

    def seen(self, model: str) -> None:
        self._get(model)

    def wrote(self, model: str, wait: bool = False) -> None:
        """``model``'s chunk landed: its manifest is recorded once (in the background, or now
        with ``wait``: a tier's put thread, so a flush also means the manifest landed)."""
        m = self._get(model)
        if m is not None:
            m.record() if wait else m.record_async()

    def wait(self, timeout: float = 5.0) -> None:
        """Wait for the manifest writes under way (at most ``timeout`` s in all): before closing."""
        deadline = time.monotonic() + timeout
        for m in list(self._manifests.values()):
            m.wait(max(0.0, deadline - time.monotonic()))

    def wrote_keys(self, keys: Any) -> None:
        """Key strings (``model@...``) that landed: each model's manifest is recorded once."""
        for model in {k.partition("@")[0] for k in keys}:
            self.wrote(model)
