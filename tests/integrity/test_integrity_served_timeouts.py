"""The served-bytes harness on a starved machine: store calls past their deadline.

A lookup, load, damage or eviction whose store call misses its deadline is a miss (or a no-op),
counted as timed out; it never ends the worker thread that ran it, which would leave the rest of
its round (its loads among them) uncounted while the run went on (kvbucket.testing.served_bytes).
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.hub_fixtures import assert_all_tls
from kvbucket.testing.served_bytes import ROUNDS_ENV, run_cell

PLAN = {"encrypted": False, "read_ahead": True, "rounds": 8, "seed": 3, "chunk_kib": 64, "damage": 0.1}


def _plan() -> dict[str, Any]:
    """``PLAN``, its 8 rounds raised by ``KVBUCKET_SERVED_ROUNDS`` as the other cells' are."""
    return {**PLAN, "rounds": int(os.environ.get(ROUNDS_ENV, PLAN["rounds"]))}


def _starved_cell(hub_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The starved plan on ``hub_bucket``'s emulator (plain HTTP or TLS), asserted."""
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda a: died.append(f"{a.thread.name if a.thread else '?'}: {a.exc_value!r}"))
    hub, plan = hub_bucket.hub, _plan()
    cfg = build_config(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/starved-{uuid.uuid4().hex[:6]}",
                       token=hub.write_token, token_env="", endpoint=hub.endpoint, retry_backoff_secs=0.01,
                       lookup_timeout_secs=0.002, load_timeout_secs=0.002)
    with HFBucketStore(cfg) as store:
        tally = run_cell(store, cell=f"{hub.endpoint.split(':')[0]} hub, 2 ms deadlines", **plan)
    planned = run_cell(FileStore(tmp_path / "dir"), cell="directory", **plan)
    assert died == []
    assert tally.timed_out > 0, tally
    assert tally.loads == planned.loads > 0
    assert tally.found < tally.loads  # the loads past their deadline were misses
    assert tally.wrong == [] and tally.valid_deleted == []
    assert planned.timed_out == planned.failed == 0
    print(f"served-bytes {hub.endpoint.split(':')[0]} hub, 2 ms deadlines: {tally.loads} loads, "
          f"{tally.found} found, {tally.timed_out} timed out, {len(tally.wrong)} wrong")


def test_a_run_past_every_deadline_counts_timeouts_and_every_load(hub_bucket: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ms lookup and load budgets on the Hub emulator: the run ends, its misses are counted as
    timed out, no worker thread dies, and it counts as many loads as the same plan on a directory."""
    _starved_cell(hub_bucket, tmp_path, monkeypatch)


def test_a_run_past_every_deadline_over_tls(hub_tls_bucket: Any, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over HTTPS, where a load's deadline cuts TLS sockets (stores/deadline.py ``_shut``:
    an ``SSLSocket`` shut there once gave its encrypted records as chunk bytes), all of the cell's
    requests, its CAS fetches among them, over TLS."""
    hub = hub_tls_bucket.hub
    before = hub.stats()["routes"]
    _starved_cell(hub_tls_bucket, tmp_path, monkeypatch)
    made = assert_all_tls(before, hub.stats()["routes"], "reconstruction", "xorb_upload")
    print(f"served-bytes over TLS, 2 ms deadlines: requests per route {made}")
