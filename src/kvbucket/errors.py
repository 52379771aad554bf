"""Exception types shared by every layer.

Messages are written for the person who has to fix the problem: they say what is wrong and
what to do. They never contain tokens or secrets (see ``kvbucket.secrets``).
"""

from __future__ import annotations

from kvbucket.secrets import redact  # stdlib only below it: no import circle


class KVBucketError(Exception):
    """Base class of every error kvbucket raises on purpose.

    Its text passes through :func:`kvbucket.secrets.redact` wherever it is shown, so a value a
    message quotes (a URL with a password, a misplaced token) is never printed in clear."""

    def __str__(self) -> str:
        text = super().__str__()
        try:
            return redact(text)
        except Exception:  # at interpreter exit the redaction's globals may be gone: show nothing
            return type(self).__name__


class ConfigError(KVBucketError, ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


class InvalidKeyError(KVBucketError, ValueError):
    """A cache key or object name is malformed or would escape its prefix."""


class StoreError(KVBucketError):
    """An object store operation failed (network, permissions, server)."""


class NotFoundError(StoreError):
    """The bucket, container or object does not exist."""


class AuthError(StoreError):
    """Credentials are missing, wrong, or lack the needed permission."""


class TransientStoreError(StoreError):
    """A failure worth retrying (throttling, 5xx, timeout, dropped connection)."""


class NoSpaceError(StoreError):
    """The filesystem under a store or tier is full (ENOSPC, EDQUOT); the write did not land.

    A local cache tier that still cannot write after evicting to make room *skips* the chunk
    with this error: :class:`~kvbucket.backends.hybrid.HybridBackend` does not fail a put that
    its other tiers stored, and metrics count it as ``skipped``.
    """


class SizeMismatchError(StoreError):
    """A stored object's size is not what the caller expected (e.g. not a full chunk)."""


class DeadlineExceededError(TransientStoreError):
    """A store call ran out of its time budget; it is reported failed (work may be abandoned)."""


class CircuitOpenError(TransientStoreError):
    """The store's circuit breaker is open after repeated failures; the call was not attempted."""
