"""The model identity of a chunk tier's names (remote tiers: :mod:`kvbucket.identity`).

One part that owns what a tier knows of identities: its ``model_identity`` setting (keys get
``<model>~<token>``), the manifests of the identities it writes under its prefix (the setting's,
and those its writer hands it, as the transformers cache does), and the once-per-process
warning when keys carry no identity at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbucket.identity.core import SEP, IdentitySetting, ModelIdentity, qualify_key_string, warn_name_only
from kvbucket.identity.manifest import ManifestBook

#: The setting named by the name-only warning (the engine YAML's key, and the constructor's).
SETTING = "extra_config.model_identity (RemoteBackend(model_identity=) in code)"


class TierIdentity:
    """See the module docstring. ``store`` is the raw store (manifests are not sealed)."""

    def __init__(self, setting: str | dict[str, str] | None, store: Any, prefix: str, where: str) -> None:
        self.setting = IdentitySetting(setting)
        self.where = where
        self._book = ManifestBook(store, prefix, self.setting, where)
        self._name_only_seen = False  # a key without an identity was named (warned once)

    def __bool__(self) -> bool:
        return bool(self.setting)

    def token(self, model: str) -> str | None:
        """``model``'s token; None: name-only; raises ``IdentityPending`` while not known yet."""
        return self.setting.token(model)

    def unknown(self, n: int = 0) -> bool:
        """Whether the identity is set but not known yet (``n`` keys counted as misses)."""
        return self.setting.unknown(n)

    def ready(self, model: str | None = None) -> bool:
        return self.setting.ready(model)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the identity is known (see :meth:`IdentitySetting.wait`)."""
        return self.setting.wait(timeout)

    def pending_counts(self) -> dict[str, int]:
        return self.setting.pending_counts()

    def key(self, key: str) -> str:
        """``key`` as named in the store: with this tier's identity token on its model."""
        model = key.partition("@")[0]
        if self.setting:
            token = self.setting.token(model)  # IdentityPending while not known yet (counted once)
            self._book.seen(model)
            return qualify_key_string(key, token)
        if not self._name_only_seen and SEP not in model:
            self._name_only_seen = True  # keys carry no identity (the transformers cache's do)
            warn_name_only(self.where, SETTING)
        return key

    def add(self, identity: ModelIdentity) -> None:
        """Keys its writer named ``<model>~<token>``: recorded with their first chunk."""
        self._book.add(identity)

    def close(self, timeout: float = 5.0) -> None:
        """Before the store closes: the manifest writes under way finish (bounded)."""
        self._book.wait(timeout)

    def wrote(self, keys: Iterable[str]) -> None:
        """Key strings (as given, before :meth:`key`) that landed: each identity's manifest once."""
        for model in {k.partition("@")[0] for k in keys}:
            self._book.wrote(model, wait=True)  # once per identity: a HEAD and a small PUT
