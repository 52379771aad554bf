"""Model identity: what changes the KV bytes of the same tokens, in every chunk name.

:mod:`.core` (the identity, its token, names with it), :mod:`.weights` (the weights part, from a
Hub commit or the files' content), :mod:`.files` (which files count, what a Hub snapshot is),
:mod:`.digest` (XXH3-128 of files and tensors), :mod:`.local_cache` (the machine's cache of file
digests), :mod:`.manifest` (which identities wrote under a namespace).
See docs/architecture.md, "Model identity".
"""

from kvbucket.identity.core import (
    IGNORED_FIELDS,
    IdentityPending,
    IdentitySetting,
    ModelIdentity,
    config_fields,
    identity_of_dir,
    qualify,
    qualify_key_string,
    split,
    split_key_string,
    token_of,
    warn_name_only,
)

__all__ = [
    "IGNORED_FIELDS",
    "IdentityPending",
    "IdentitySetting",
    "ModelIdentity",
    "config_fields",
    "identity_of_dir",
    "qualify",
    "qualify_key_string",
    "split",
    "split_key_string",
    "token_of",
    "warn_name_only",
]
