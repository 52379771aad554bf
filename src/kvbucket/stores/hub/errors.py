"""What a failed Hub or Xet call means for the user: one kvbucket error that names the cause and
the fix (:func:`hub_error`), and which failures are worth a retry.

Wording follows ``hf`` (huggingface_hub 2.4's CLI): a bucket the caller cannot see is "not
found", created with ``hf buckets create``; a caller without a token is told to set ``HF_TOKEN``
or run ``hf auth login``; a token answered HTTP 401 is invalid or expired ("Invalid user token"),
never a missing permission (that is 403). Secrets never appear: the detail of a client error is
redacted with the client's tokens, and the endpoint is shown without userinfo.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import httpx2
from huggingface_hub.errors import BucketNotFoundError, HfHubHTTPError

from kvbucket.errors import AuthError, NotFoundError, StoreError, TransientStoreError
from kvbucket.secrets import redact
from kvbucket.stores.hub.refused import connection_refused
from kvbucket.stores.hub.whoami import TokenRefusedError, refused_text

RETRY_STATUS = (408, 429, 500, 502, 503, 504)
RETRY_EXCEPTIONS = (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)
# hf_xet raises a plain ConnectionError for any failed request, an answered one included:
# "Network error: Request error: HTTP status client error (413 Payload Too Large), domain: ..."
_XET_STATUS = re.compile(r"HTTP status (?:client|server) error \((\d{3})")


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a failed request was answered with: httpx's response, or the one hf_xet
    names in its error (it raises ConnectionError for a 4xx answer as for a reset)."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return status
    m = _XET_STATUS.search(str(exc))
    return int(m.group(1)) if m else None


class HubContext(NamedTuple):
    """What an error message names: never a token."""

    endpoint: str  # redacted
    bucket_id: str
    token_source: str  # words naming where the token came from
    anonymous: bool  # no Authorization header was sent
    max_retries: int


def hub_error(exc: BaseException, what: str, ctx: HubContext, secrets: list[str]) -> StoreError:
    """Translate any exception of a Hub/Xet call into a kvbucket error a user can act on."""
    if isinstance(exc, StoreError):
        return exc
    status = http_status(exc)
    text = str(exc).strip()
    detail = redact(text.splitlines()[0] if text else type(exc).__name__, *secrets)
    endpoint, bucket = ctx.endpoint, ctx.bucket_id
    if status == 401 and ctx.anonymous:
        # The Hub answers a caller without a token 401 for a private bucket and a missing one
        # alike (RepoNotFound), and for any write: the first fix is a token, as `hf` says.
        return AuthError(
            f"no token found: {endpoint} answered HTTP 401 for bucket {bucket!r} while trying "
            f"to {what} (a private or missing bucket looks the same without a token); set HF_TOKEN or "
            f"run `hf auth login` (to create the bucket: hf buckets create {bucket} --private)"
        )
    if isinstance(exc, BucketNotFoundError) or (status == 404 and "bucket" in what):
        return NotFoundError(
            f"bucket {bucket!r} not found on {endpoint} (or the token from {ctx.token_source} "
            f"cannot see it) while trying to {what}; create it with: hf buckets create "
            f"{bucket} --private (a store's config may set create_bucket_if_missing: true)"
        )
    if status == 401:  # a token was sent and refused: invalid or expired, as `hf` says ("Invalid user token")
        return TokenRefusedError(refused_text(ctx.token_source, endpoint,
                                              f" while trying to {what} of bucket {bucket!r}"))
    if status == 403 or type(exc).__name__ == "XetAuthenticationError":
        need = "write access" if status == 403 or "write" in what or "remove" in what else "access"
        return AuthError(
            f"the Hub refused access to bucket {bucket!r} on {endpoint} "
            f"(HTTP {status or 'auth'}) while trying to {what}; the token from {ctx.token_source} "
            f"needs {need} to the bucket: use a token with {need} (hf auth login, or set HF_TOKEN)"
        )
    if connection_refused(exc):
        return TransientStoreError(
            f"connection refused by {endpoint} while trying to {what} on bucket {bucket!r}: "
            "no server listens there (not retried)"
        )
    # A 4xx is an answer (retried never: the same request gets the same answer), a 5xx or a
    # reset is transient; 408 and 429 too, as hf_xet's and httpx's own retries have them.
    transient_exc = isinstance(exc, (*RETRY_EXCEPTIONS, TimeoutError, ConnectionError))
    if status in RETRY_STATUS or (status or 0) >= 500 or (status is None and transient_exc):
        return TransientStoreError(
            f"the Hub did not answer usefully for bucket {bucket!r} while trying to {what} "
            f"after {ctx.max_retries} retries: {detail}"
        )
    if status == 404:
        return NotFoundError(f"not found on {endpoint} while trying to {what}: {detail}")
    if isinstance(exc, HfHubHTTPError) or status is not None:
        code = f" (HTTP {status})" if status is not None else ""
        return StoreError(f"the Hub rejected the request to {what} on bucket {bucket!r}{code}: {detail}")
    return StoreError(f"failed to {what} on bucket {bucket!r}: {type(exc).__name__}: {detail}")


__all__ = ["RETRY_EXCEPTIONS", "RETRY_STATUS", "HubContext", "connection_refused", "http_status", "hub_error"]
