"""``open_file_store``: a directory store from a ``file://`` URL or a path, with its options."""

from __future__ import annotations

from typing import Any

from kvbucket.did_you_mean import with_hints
from kvbucket.errors import ConfigError
from kvbucket.stores.local.file import FileStore

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"file store option {key}={value!r} must be true or false")


_FILE_OPTIONS = ("fsync", "create", "stale_tmp_secs")


def open_file_store(url: str, **options: Any) -> FileStore:
    """Open ``file:///abs/dir``, ``file://rel/dir`` (relative to the working directory) or a path.

    Everything after ``file://`` is the path, taken verbatim (no percent-decoding, no host part),
    so ``file:///data/kv`` is ``/data/kv`` and ``file://kv`` is ``./kv``; ``~`` is expanded.
    Options: ``fsync`` (bool), ``create`` (bool, default True), ``stale_tmp_secs`` (float).
    """
    if not isinstance(url, str):
        raise ConfigError(f"a file store URL must be a string, got {type(url).__name__}")
    path = url[len("file://") :] if url.startswith("file://") else url
    if not path:
        raise ConfigError(f"{url!r} names no directory; use file:///absolute/dir or file://relative/dir")
    unknown = set(options) - set(_FILE_OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown file store option(s) {with_hints(sorted(unknown), _FILE_OPTIONS)}; "
            f"known: {', '.join(_FILE_OPTIONS)}"
        )
    kwargs: dict[str, Any] = {}
    for key in ("fsync", "create"):
        if key in options:
            kwargs[key] = _as_bool(key, options[key])
    if "stale_tmp_secs" in options:
        try:
            kwargs["stale_tmp_secs"] = float(options["stale_tmp_secs"])
        except (TypeError, ValueError):
            value = options["stale_tmp_secs"]
            raise ConfigError(f"stale_tmp_secs={value!r} must be a number of seconds") from None
    return FileStore(path, **kwargs)


__all__ = ["open_file_store"]
