"""Upload errors classified (issue 29 item 7): a 4xx answer from Xet storage is permanent (401 and
403 an authentication error) and retried never; before, a 413, 400 or 403 on ``xorb_upload``
was retried as transient (6 attempts, 15.6 s with the default backoff) and a 403 never became
an AuthError. hf_xet reports any failed request as a ``ConnectionError`` whose message names the
status; a reset has none and stays transient."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvbucket.errors import AuthError, StoreError, TransientStoreError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.errors import http_status
from kvbucket.stores.hub.store import HFBucketStore


def _store(hub_bucket: Any) -> HFBucketStore:
    return HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/up", token=hub_bucket.hub.write_token,
        endpoint=hub_bucket.hub.endpoint, token_env="", retry_backoff_secs=0.01, breaker_failures=0,
    ))


@pytest.mark.parametrize(("status", "kind"), [(413, StoreError), (400, StoreError), (403, AuthError)])
def test_a_4xx_on_xorb_upload_is_permanent_and_sent_once(hub_bucket: Any, status: int, kind: type) -> None:
    hub = hub_bucket.hub
    with _store(hub_bucket) as store:
        assert store.put_many([("warm", b"w" * 100)])[0].ok  # token and commit ready
        hub.faults.add("xorb_upload", status=status)
        (r,) = store.put_many([("a", os.urandom(10_000))])
        assert type(r.error) is kind, r.error  # not a TransientStoreError (a subclass of StoreError)
        assert f"HTTP {status}" in str(r.error)
        (rule,) = hub.faults.rules()
        assert rule["seen"] == 1, rule  # one upload request: no retry by kvbucket (nor by hf_xet)
        hub.faults.reset()
        assert store.head_many(["a"])[0].size is None  # nothing was added
        assert store.put_many([("a", b"ok")])[0].ok


def test_hf_xet_errors_give_their_status_and_a_reset_has_none() -> None:
    answered = ConnectionError("Network error: Request error: HTTP status client error (413 Payload Too "
                               "Large), domain: http://127.0.0.1:1/cas/v1/xorbs/default/ab")
    assert http_status(answered) == 413
    assert http_status(ConnectionError("Network error: Request error: HTTP status server error "
                                       "(503 Service Unavailable), domain: http://h/")) == 503
    assert http_status(ConnectionError("Network error: error sending request: connection reset")) is None
    from kvbucket.stores.hub.client import HubBucketClient

    client = HubBucketClient(endpoint="http://127.0.0.1:1", bucket_id="o/b", token=None, token_source="none")
    try:
        assert type(client.error(answered, "upload objects")) is StoreError
        reset = ConnectionError("Network error: error sending request: connection reset by peer")
        assert isinstance(client.error(reset, "upload objects"), TransientStoreError)
        server = ConnectionError("Network error: Request error: HTTP status server error (507 Insufficient "
                                 "Storage), domain: http://h/")
        assert isinstance(client.error(server, "upload objects"), TransientStoreError)
        throttled = ConnectionError("Request error: HTTP status client error (429 Too Many Requests)")
        assert isinstance(client.error(throttled, "upload objects"), TransientStoreError)
    finally:
        client.close()
