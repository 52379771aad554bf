"""Issue 40 (outside tester, F1): an adapter whose every store fails must not report healthy.

After a failed put the adapter asks the store which objects landed; that HEAD answered, and the
answer moved the put's error to ``previous_error``: ``is_healthy: true`` with a read-only token
that stores nothing. An error now clears only on a success of its own kind."""

from __future__ import annotations

from kvbucket.keys import ObjectKey
from kvbucket.l2 import open_l2_adapter
from kvbucket.testing import l2 as t
from kvbucket.testing.hub_fixtures import HubBucket

CHUNK = 16 * 1024


def k(i: int) -> ObjectKey:
    return ObjectKey("Qwen/Qwen3-8B", 0x01000100, i.to_bytes(16, "big"), "")


def test_read_only_token_never_reads_as_healthy_after_failed_stores(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    with open_l2_adapter({"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/ro",
                          "token": hub.write_token, "endpoint": hub.endpoint, "model_identity": "v3",
                          "max_retries": 0, "full_chunk_bytes": CHUNK}) as w:  # fmt: skip
        assert w.wait_until_rebuilt(30)
        assert t.store(w, [k(0)], [b"\1" * CHUNK]).success  # something a read-only token can read
    spec = {"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/ro",
            "token": hub.read_token, "endpoint": hub.endpoint, "model_identity": "v3", "max_retries": 0,
            "max_capacity_gb": 1, "full_chunk_bytes": CHUNK, "read_ahead": False}  # fmt: skip
    with open_l2_adapter(spec) as a:
        assert a.wait_until_rebuilt(30)
        for i in range(1, 4):
            assert not t.store(a, [k(i)], [bytes([i]) * CHUNK]).success
        s = a.report_status()
        assert s["stores"] == 0 or s["store_failures"] >= 3, s
        assert not s["is_healthy"], s
        assert s["last_error"] and ("403" in s["last_error"] or "refused" in s["last_error"]), s["last_error"]
        assert s["previous_error"] is None
        # Reads work with this token: a lookup and a load answer, and still the stores do not.
        assert t.lookup(a, [k(0)]) == [True]
        buf = bytearray(CHUNK)
        assert t.load(a, [k(0)], [buf]) == [True] and buf == b"\1" * CHUNK
        a.submit_unlock([k(0)])
        s = a.report_status()
        assert not s["is_healthy"] and s["last_error"], s


def test_missing_bucket_is_one_line_not_a_traceback(hub_bucket: HubBucket, caplog) -> None:
    """F11: the startup listing of a missing bucket logged a 20-line traceback under one line
    that already says it; the line stays, the traceback goes (it is not a bug)."""
    hub = hub_bucket.hub
    caplog.set_level("WARNING", logger="kvbucket")
    spec = {"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub.namespace}/no-such-bucket-f11/kv",
            "token": hub.write_token, "endpoint": hub.endpoint, "model_identity": "v3", "max_retries": 0}
    with open_l2_adapter(spec) as a:
        assert a.wait_until_rebuilt(30)
        assert not a.report_status()["is_healthy"]
    rebuild = [r for r in caplog.records if "to rebuild usage" in r.getMessage()]
    assert rebuild, [r.getMessage() for r in caplog.records]
    assert all(r.exc_info is None for r in rebuild), "a traceback for a missing bucket"
    assert "no-such-bucket-f11" in rebuild[0].getMessage()
