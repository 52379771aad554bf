"""docs/fleet.md: nodes sharing a prefix without ``"fleet"`` (issue 40, outside tester F2).

The doc said each node "only counts what it stored itself"; in truth a node counts what its
startup listing found under the prefix, so a node starting with a smaller capacity evicts the
others' chunks, locked or not. What the doc now says is asserted here: the new node's usage
includes the other's chunks, it evicts to its own capacity, and the other node's loads of what
was evicted are misses (never wrong bytes)."""

from __future__ import annotations

import time

from kvbucket.keys import ObjectKey
from kvbucket.l2 import open_l2_adapter
from kvbucket.testing import l2 as t
from kvbucket.testing.hub_fixtures import HubBucket

CHUNK = 16 * 1024
N = 24


def k(i: int) -> ObjectKey:
    return ObjectKey("Qwen/Qwen3-8B", 0x01000100, i.to_bytes(16, "big"), "")


def chunk(i: int) -> bytes:
    return bytes([i % 251 + 1]) * CHUNK


def test_a_node_counts_the_whole_prefix_and_evicts_to_its_own_capacity(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub

    def spec(gb: float) -> dict:
        return {"type": "hfbucket", "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/shared",
                "token": hub.write_token, "endpoint": hub.endpoint, "model_identity": "v1",
                "max_capacity_gb": gb, "read_ahead": False, "full_chunk_bytes": CHUNK,
                # a Hub writer adds back, recheck_delay_secs after its commit, what another process
                # deleted (docs/hfbucket.md): off here, so b's eviction is what a sees
                "recheck_delay_secs": 0}  # fmt: skip

    with open_l2_adapter(spec(1)) as a:
        assert a.wait_until_rebuilt(30)
        assert t.store(a, [k(i) for i in range(N)], [chunk(i) for i in range(N)]).success
        assert t.lookup(a, [k(i) for i in range(5)]) == [True] * 5  # locked in this process only
        small = 8 * CHUNK / 1e9
        with open_l2_adapter(spec(small)) as b:
            assert b.wait_until_rebuilt(30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and b.report_status()["bytes_used"] > small * 1e9:
                time.sleep(0.1)
            sb = b.report_status()
            assert sb["evicted_keys"] > 0 and sb["bytes_used"] <= small * 1e9, sb  # a's chunks counted
        bufs = [bytearray(CHUNK) for _ in range(N)]
        got = t.load(a, [k(i) for i in range(N)], bufs)
        # a lock in a is invisible to b: a's chunks, locked ones included, left the bucket. a may still
        # read one by the Xet hash it holds (the emulator serves a hash to a bucket that may add it back,
        # docs/emulator.md), so what a loads is checked for its bytes only.
        assert sb["keys"] <= 8 and sb["evicted_keys"] >= N - 8, sb
        for i, ok in enumerate(got):
            assert not ok or bytes(bufs[i]) == chunk(i), i  # a miss, never wrong bytes
        a.submit_unlock([k(i) for i in range(5)])
