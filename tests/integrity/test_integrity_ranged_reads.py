"""The served-bytes invariant on ranged reads (issue 41): objects read in parts, in parallel,
while parts fail, arrive late, or land in a read-ahead that a load redirects.

The randomized suite of kvbucket.testing.served_bytes (loads at random moments around lookups,
read-aheads, puts and deletes of the same names, from several threads) over a store whose every
chunk is read in about four ranges, with faults injected into a share of those ranged fetches.
``KVBUCKET_SERVED_ROUNDS`` raises the rounds (``make test`` runs the defaults).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.served_bytes import run_cell, settings_from_env


@pytest.mark.parametrize("read_ahead", [False, True], ids=["direct", "read_ahead"])
@pytest.mark.parametrize("encrypted", [False, True], ids=["sealed", "encrypted"])
def test_hub_ranged_reads_serve_only_stored_bytes(hub_bucket: Any, encrypted: bool, read_ahead: bool) -> None:
    rounds, seed, chunk_kib = settings_from_env()
    hub = hub_bucket.hub
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/rng-{uuid.uuid4().hex[:6]}",
                       token=hub.write_token, token_env="", endpoint=hub.endpoint, retry_backoff_secs=0.01,
                       read_part_bytes=max(16 << 10, chunk_kib * 1024 // 4))
    hub.faults.add("fetch", status=503, probability=0.03)  # a range failing
    hub.faults.add("fetch", drop=True, probability=0.03)  # a range cut mid-body
    hub.faults.add("fetch", latency_s=0.02, probability=0.15)  # a range late
    try:
        with HFBucketStore(cfg) as store:
            tally = run_cell(store, encrypted=encrypted, read_ahead=read_ahead, rounds=rounds, seed=seed,
                             chunk_kib=chunk_kib,
                             cell=f"hub ranged encrypted={encrypted} read_ahead={read_ahead}")
        fired = sum(r["fired"] for r in hub.faults.rules())
    finally:
        hub.faults.reset()
    print(f"served-bytes hub ranged encrypted={encrypted} read_ahead={read_ahead}: {tally.loads} loads, "
          f"{tally.found} found, {len(tally.wrong)} wrong, {fired} faults")
    assert tally.wrong == [], "\n".join(tally.wrong[:10])
    assert tally.found > 0 and fired > 0
