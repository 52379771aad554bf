"""Store URLs as users type them: the one rule that tells a Hub bucket id from a local path.

``hf buckets list alice/kv`` takes a bucket id (``namespace/bucket[/prefix]``,
huggingface_hub's ``_parse_bucket_uri``); kvbucket takes the same ids wherever it takes a store
URL. A string without ``://`` is a local path when it can only be one, else a bucket id:

1. ``/abs``, ``./rel``, ``../rel``, ``~/...``, ``.``, ``..``: always a local path;
2. a path whose first segment exists here (``alice/kv`` with a file or directory ``alice`` in
   the working directory): a local path, the existing one wins;
3. ``namespace/bucket[/prefix]`` whose first two segments are valid Hub names: the bucket id
   ``hf://buckets/namespace/bucket[/prefix]``;
4. anything else (``cache``, ``my dir/x``): a local path.

So ``kvbucket ls alice/kv`` lists the bucket unless ``./alice`` exists, and ``./alice/kv`` is
always the directory. Everything with ``://`` is left as written. A command that removes things
does not apply rule 2: text that is both (:func:`ambiguous`) is refused, so a removal never
depends on which directory it runs from; nor does a configured URL (an engine's ``remote_url``,
$KVBUCKET_REMOTE_URL: :func:`resolve_configured_url`), so a server never depends on it either.
"""

from __future__ import annotations

import os
import re

HANDLE_SCHEME = "hf://buckets/"

#: The Hub's repo-name rule (huggingface_hub.utils.validate_repo_id): 1-96 chars of [A-Za-z0-9._-],
#: not starting or ending with '-' or '.', no '--' or '..'.
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")

_LOCAL_STARTS = ("/", "./", "../", "~")


def is_hub_name(value: str) -> bool:
    """True when ``value`` is a valid Hub namespace or bucket name."""
    return bool(NAME_RE.match(value)) and "--" not in value and ".." not in value


def bucket_id_url(text: str) -> str | None:
    """``hf://buckets/<text>`` when ``text`` (no scheme) is shaped as a bucket id, else None.

    Only the shape is checked (the existing-path rule is :func:`resolve_store_url`'s)."""
    if "://" in text or text.startswith(_LOCAL_STARTS) or text in (".", ".."):
        return None
    parts = text.split("/", 2)
    if len(parts) < 2 or not (is_hub_name(parts[0]) and is_hub_name(parts[1])):
        return None
    return HANDLE_SCHEME + text


def ambiguous(text: str) -> bool:
    """True when ``text`` is shaped as a bucket id and its first segment also exists here: it
    names a local path by rule 2 but the bucket from any other directory."""
    if not isinstance(text, str) or bucket_id_url(text) is None:
        return False
    return os.path.lexists(text.split("/", 1)[0])


def resolve_store_url(url: str) -> str:
    """The store URL ``url`` names: a bucket id becomes ``hf://buckets/...``; anything else is
    returned unchanged (a path stays a path). See the module's rule."""
    if not isinstance(url, str):
        return url
    handle = bucket_id_url(url)
    if handle is None or os.path.lexists(url.split("/", 1)[0]):
        return url
    return handle


def both_spellings(text: str, what: str) -> str:
    """Why ``text`` (:func:`ambiguous`) is refused by ``what``, naming how to write each meaning."""
    first = text.split("/", 1)[0]
    return (f"{text!r} is both the local path ./{text} (./{first} exists here) and the Hub bucket id "
            f"{HANDLE_SCHEME}{text}; {what} does not guess: write ./{text} for the local directory "
            f"or {HANDLE_SCHEME}{text} for the bucket")


def resolve_configured_url(url: str, what: str) -> str:
    """A store URL read from a configuration (an engine's ``remote_url``, $KVBUCKET_REMOTE_URL):
    the CLI's rule (a bucket id is the bucket), except that text which is both a bucket id and
    an existing local path is refused (ValueError) rather than resolved by the directory a server
    happens to start in."""
    if ambiguous(url):
        raise ValueError(both_spellings(url, what))
    return resolve_store_url(url)


__all__ = ["HANDLE_SCHEME", "NAME_RE", "ambiguous", "both_spellings", "bucket_id_url", "is_hub_name",
           "resolve_configured_url", "resolve_store_url"]
