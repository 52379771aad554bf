"""Openers of ``HFBucketStore``: ``open_store("hf://buckets/...")``, the non-MP ``hfbucket``
remote storage plugin (seed 001) and ``remote_url: hf://buckets/...``.

Apart from the store itself so that the store module holds the object-store protocol only.
"""

from __future__ import annotations

from typing import Any

from kvbucket.errors import ConfigError
from kvbucket.stores.hub.config import (
    build_config,
    config_from_plugin_options,
    lenient_bool,
    parse_bucket_handle,
)
from kvbucket.stores.hub.store import HFBucketStore


def open_hfbucket_store(url: str, *, create: bool | None = None, prestart: bool = True,
                        **options: Any) -> HFBucketStore:
    """``open_store("hf://buckets/ns/name[/prefix]", **options)``; options are HFBucketConfig fields.

    Endpoint and token follow huggingface_hub: ``$HF_ENDPOINT`` and ``$HF_TOKEN`` (or the saved
    login) unless ``endpoint``/``token``/``token_env`` say otherwise. ``create`` is the generic
    opener flag (the CLI passes ``create=False`` to inspect without creating anything); it sets
    ``create_bucket_if_missing`` unless that option is given too. ``prestart=False`` starts the
    store's load and request threads when a batch needs them, not when it opens (the CLI's
    one-shot commands: see :class:`HFBucketStore`).
    """
    if "bucket_handle" in options:
        raise ConfigError("give the bucket either as the URL or as bucket_handle, not both")
    if create is not None:
        options.setdefault("create_bucket_if_missing", bool(create))
    parse_bucket_handle(url, "store URL")  # a malformed URL's error names the URL, not a config key
    return HFBucketStore(build_config(bucket_handle=url, **options), prestart=prestart)


def _check_engine(engine: Any, where: str) -> None:
    """The hfbucket plugin stores full chunks only, without inline chunk metadata (seed 001)."""
    if lenient_bool("save_unfull_chunk", getattr(engine, "save_unfull_chunk", False) or False):
        raise ConfigError(
            f"{where} stores full chunks only: set save_unfull_chunk: false in the engine config "
            "(partial chunks would be refused on every store)"
        )
    extra = getattr(engine, "extra_config", None) or {}
    meta = getattr(engine, "save_chunk_meta", None)
    if meta is None and isinstance(extra, dict):
        meta = extra.get("save_chunk_meta")
    if meta is not None and lenient_bool("save_chunk_meta", meta):
        raise ConfigError(
            f"{where} does not store chunk metadata: set extra_config.save_chunk_meta: false (or remove it)"
        )


def store_from_plugin_options(instance_name: str, options: dict[str, Any], engine: Any) -> HFBucketStore:
    """Build the store of ``remote_storage_plugins: ["hfbucket[.<instance>]"]`` (seed 001).

    ``options`` are the keys under ``remote_storage_plugin.<instance_name>.`` with that prefix
    removed, exactly as in LMCache's YAML (bools may be "true"/"1"/"yes"/"on").
    """
    _check_engine(engine, f"the {instance_name!r} remote storage plugin")
    return HFBucketStore(config_from_plugin_options(instance_name, dict(options)))


_URL_OPTION_PREFIX = "hfbucket."


def store_from_remote_url(url: str, extra_config: dict[str, Any], engine: Any) -> HFBucketStore:
    """Build the store of ``remote_url: hf://buckets/...``.

    Options may come from ``extra_config`` as ``hfbucket.<field>`` (e.g. ``hfbucket.token_env``);
    any other key is an error naming it (``save_chunk_meta`` is checked, then ignored).
    """
    _check_engine(engine, f"remote_url {url!r}")
    options: dict[str, Any] = {}
    unknown = []
    for k, v in (extra_config or {}).items():
        if k == "save_chunk_meta":
            continue
        if k.startswith(_URL_OPTION_PREFIX):
            options[k[len(_URL_OPTION_PREFIX) :]] = v
        else:
            unknown.append(k)
    if unknown:
        raise ConfigError(
            f"extra_config key(s) {', '.join(map(repr, sorted(unknown)))} are not used by "
            f"remote_url {url!r}; "
            f"options of an hf:// remote_url are written hfbucket.<option> (e.g. hfbucket.token_env)"
        )
    if "bucket_handle" in options:
        raise ConfigError(
            "hfbucket.bucket_handle cannot be combined with remote_url; the URL names the bucket"
        )
    return HFBucketStore(config_from_plugin_options("hfbucket", {"bucket_handle": url, **options}))


__all__ = ["open_hfbucket_store", "store_from_plugin_options", "store_from_remote_url"]
