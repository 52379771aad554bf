"""What the read path of HFBucketStore prepares, and when (stores/hub_client.py, xet_reads.py).

Counts and objects, never times: in a fresh process the first lookup paid for setting up HTTP
clients (loading CA certificates into TLS contexts) on the inference path; opening the store
now does that work instead, once.
"""

from __future__ import annotations

import pytest

from kvbucket.stores import xet_reads
from kvbucket.stores.hfbucket import HFBucketStore
from kvbucket.stores.hfbucket_config import build_config


def test_https_connections_share_one_tls_context() -> None:
    """http.client makes (and loads CA certificates into) a TLS context per connection unless
    given one; the reader's connections share one."""
    conns = xet_reads._Connections(4)
    c1, reused1 = conns.get("https", "cas.example:443", 5.0)
    c2, reused2 = conns.get("https", "cas.example:443", 5.0, fresh=True)
    c3, _ = conns.get("https", "other.example:443", 5.0)
    assert not reused1 and not reused2
    assert c1 is not c2
    assert c1._context is c2._context is c3._context is conns.tls()  # type: ignore[attr-defined]
    conns.close()


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://hub.example"])
def test_opening_a_store_makes_its_http_clients_so_the_first_lookup_does_not(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's process-wide client (which build_hf_headers only makes when telemetry
    is on) and, for an HTTPS Hub, the reader's TLS context exist once the store is open; no
    request is made."""
    from huggingface_hub.utils import _http

    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY", True)
    _http.close_session()
    made: list[object] = []
    factory = _http._GLOBAL_CLIENT_FACTORY

    def counting() -> object:
        made.append(factory())
        return made[-1]

    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", counting)
    store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b/p", token="hf_x", token_env="",
                                       endpoint=endpoint))
    try:
        assert len(made) == 1 and _http.get_session() is made[0]
        reader = store._client._reader
        assert (reader._conns._tls is not None) == endpoint.startswith("https:")
        assert not reader._conns._idle  # nothing was connected
    finally:
        store.close()
        _http.close_session()
