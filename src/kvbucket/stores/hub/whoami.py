"""Who a Hub token belongs to: ``doctor``'s token check and the ``me`` namespace of bucket ids.

``hf buckets create me/x`` sends ``me`` to the Hub, which reads it as the caller (huggingface_hub
2.4's ``create_bucket`` and ``list_buckets`` pass it through). Other bucket routes (tree,
paths-info, Xet tokens, batch) name a bucket by its real namespace, so kvbucket resolves ``me``
once, as ``hf auth whoami`` does (huggingface_hub's ``whoami`` on ``/api/whoami-v2``), and then
uses the caller's name everywhere. One answer per (endpoint, token) and process.
"""

from __future__ import annotations

import threading
from typing import Any

from kvbucket.errors import AuthError, ConfigError, DeadlineExceededError, StoreError, TransientStoreError
from kvbucket.stores.deadline import deadline_in, run_abandonable
from kvbucket.stores.hub.config import BucketLocation, HFBucketConfig
from kvbucket.stores.hub.refused import connection_refused

#: the namespace huggingface_hub and the Hub read as "the caller"
ME = "me"
WHOAMI_TIMEOUT_S = 10.0

_lock = threading.Lock()
_names: dict[tuple[str, str], str] = {}


class TokenRefusedError(AuthError):
    """The Hub answered HTTP 401 to a token: it is invalid or expired (not a missing permission)."""


def refused_text(token_source: str, endpoint: str, while_: str = "") -> str:
    """What a 401 to a token means, in ``hf``'s words ("Invalid user token"), with the fix."""
    return (f"the token from {token_source} was refused by {endpoint} (HTTP 401){while_}: it is invalid or "
            "expired; create a new one at https://huggingface.co/settings/tokens and set HF_TOKEN or "
            "run `hf auth login --force`")


def whoami(endpoint: str, token: str, timeout: float = WHOAMI_TIMEOUT_S, *,
           token_source: str = "$HF_TOKEN", deadline: float | None = None) -> dict[str, Any]:
    """huggingface_hub's ``whoami`` on ``endpoint``, bounded: the answer (``name``, ``orgs``, ...),
    :class:`TokenRefusedError` for HTTP 401, :class:`StoreError` when the Hub did not answer."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    def call() -> dict[str, Any]:
        return HfApi(endpoint=endpoint).whoami(token=token)

    try:
        return run_abandonable(call, deadline if deadline is not None else deadline_in(timeout),
                               lambda: DeadlineExceededError(
                                   f"{endpoint} did not answer /api/whoami-v2 within {timeout:g} s"))
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status == 401:
            raise TokenRefusedError(refused_text(token_source, endpoint)) from None
        raise StoreError(f"{endpoint} answered /api/whoami-v2 with HTTP {status}") from None
    except StoreError:
        raise
    except Exception as e:  # unreachable, reset: what the user checks is the endpoint
        if connection_refused(e):  # the words of every other Hub call (stores/hub/errors.py)
            raise TransientStoreError(f"connection refused by {endpoint} while asking who the token "
                                      "belongs to (the namespace 'me'): no server listens there "
                                      "(not retried)") from None
        raise StoreError(f"cannot ask {endpoint} who the token belongs to: {type(e).__name__}: {e}") from None


def caller_name(endpoint: str, token: str | None, token_source: str, timeout: float = WHOAMI_TIMEOUT_S,
                deadline: float | None = None) -> str:
    """The user name ``me`` stands for with this token (asked once per process)."""
    if not token:
        raise AuthError("the namespace 'me' means the token's user, and no token was found: set HF_TOKEN or "
                        "run `hf auth login`, or write the namespace")
    key = (endpoint, token)
    with _lock:
        if key in _names:
            return _names[key]
    name = whoami(endpoint, token, timeout, token_source=token_source, deadline=deadline).get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{endpoint}'s /api/whoami-v2 names no user: write the namespace instead of 'me'")
    with _lock:
        _names[key] = name
    return name


def as_caller(config: HFBucketConfig) -> HFBucketConfig:
    """``config`` with the namespace ``me`` of its bucket replaced by the token's user (itself when
    it names another namespace)."""
    loc = config.location
    if loc.namespace != ME:
        return config
    name = caller_name(config.resolved_endpoint(), config.resolved_token(), config.token_source(),
                       config.connect_timeout_secs + config.request_timeout_secs)
    return config.model_copy(update={"bucket_handle": BucketLocation(name, loc.bucket, loc.prefix).handle})


__all__ = ["ME", "TokenRefusedError", "as_caller", "caller_name", "refused_text", "whoami"]
