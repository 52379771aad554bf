"""Model identity: what changes the KV bytes of the same tokens, in every chunk name.

:mod:`.core` (the identity, its token, names with it), :mod:`.weights` (the weights part, from a
Hub commit or the weight files), :mod:`.manifest` (which identities wrote under a namespace).
See docs/architecture.md, "Model identity".
"""

from kvbucket.identity.core import (
    ATTENTION_FIELDS,
    ModelIdentity,
    config_fields,
    qualify,
    qualify_key_string,
    split,
    split_key_string,
    token_of,
    warn_name_only,
)

__all__ = [
    "ATTENTION_FIELDS",
    "ModelIdentity",
    "config_fields",
    "qualify",
    "qualify_key_string",
    "split",
    "split_key_string",
    "token_of",
    "warn_name_only",
]
