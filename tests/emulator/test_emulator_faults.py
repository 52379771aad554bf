"""Fault injection drives the real clients' retry and partial-failure paths."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub.errors import BucketBatchError, HfHubHTTPError

from kvbucket.testing import FaultControl
from kvbucket.testing.hub_emulator import HubEmulator
from kvbucket.testing.hub_emulator.wire import STOP_GRACE_S
from kvbucket.testing.hub_fixtures import HubBucket


def _fired(faults: FaultControl) -> list[int]:
    return [r["fired"] for r in faults.rules()]


def test_503_on_batch_is_retried_by_the_client(hub_bucket: HubBucket, hub_faults: FaultControl) -> None:
    hub_faults.add("batch", status=503, nth=1)
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(b"retry me", "r.txt")])
    assert _fired(hub_faults) == [1]
    assert [f.path for f in hub_bucket.api.list_bucket_tree(hub_bucket.bucket_id)] == ["r.txt"]


def test_persistent_500_surfaces_as_an_error(hub_bucket: HubBucket, hub_faults: FaultControl) -> None:
    hub_faults.add("bucket_info", status=500)
    with pytest.raises(HfHubHTTPError) as e:
        hub_bucket.api.bucket_info(hub_bucket.bucket_id)
    assert e.value.response.status_code == 500
    hub_faults.reset()
    assert hub_bucket.api.bucket_info(hub_bucket.bucket_id).id == hub_bucket.bucket_id


def test_failed_batch_line_is_reported_per_item(hub_bucket: HubBucket, hub_faults: FaultControl) -> None:
    hub_faults.add("batch", fail_batch_line=2, times=1)
    with pytest.raises(BucketBatchError) as e:
        hub_bucket.api.batch_bucket_files(
            hub_bucket.bucket_id, add=[(b"1", "one"), (b"2", "two"), (b"3", "three")]
        )
    assert [f["path"] for f in e.value.failures] == ["two"]
    landed = {f.path for f in hub_bucket.api.list_bucket_tree(hub_bucket.bucket_id)}
    assert landed == {"one", "three"}


def test_429_on_xorb_upload_and_dropped_fetch_are_retried_by_hf_xet(
    hub_bucket: HubBucket, hub_faults: FaultControl, tmp_path: Path
) -> None:
    data = os.urandom(1_000_000)
    hub_faults.add("xorb_upload", status=429, nth=1)
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(data, "x.bin")])
    hub_faults.add("fetch", drop=True, nth=1)  # half the body, then the connection is cut
    hub_faults.add("reconstruction", status=503, nth=1)
    hub_bucket.api.download_bucket_files(hub_bucket.bucket_id, [("x.bin", tmp_path / "x.bin")])
    assert (tmp_path / "x.bin").read_bytes() == data
    assert _fired(hub_faults) == [1, 1, 1]


def test_latency_and_probability_rules(hub_bucket: HubBucket, hub_faults: FaultControl) -> None:
    hub_faults.add("tree", latency_s=0.05, times=2)
    for _ in range(3):
        assert list(hub_bucket.api.list_bucket_tree(hub_bucket.bucket_id)) == []
    ((rule),) = hub_faults.rules()
    assert (rule["seen"], rule["fired"]) == (3, 2)
    hub_faults.reset()
    hub_faults.add("paths_info", status=500, probability=0.0)
    assert list(hub_bucket.api.get_bucket_paths_info(hub_bucket.bucket_id, ["a"])) == []
    assert _fired(hub_faults) == [0]


def test_bad_rules_and_missing_admin_key_are_refused(hub_bucket: HubBucket, hub_faults: FaultControl) -> None:
    with pytest.raises(ValueError, match="unknown route"):
        hub_faults.add("no-such-route", status=500)
    with pytest.raises(ValueError, match="4xx or 5xx"):
        hub_faults.add("tree", status=200)
    req = urllib.request.Request(
        f"{hub_bucket.hub.endpoint}/_emulator/faults",
        data=json.dumps({"route": "tree", "status": 500}).encode(),
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403
    assert hub_faults.rules() == []


def test_stats_count_requests_and_bytes_per_route(hub_bucket: HubBucket, tmp_path: Path) -> None:
    before = hub_bucket.hub.stats()
    data = os.urandom(500_000)
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(data, "s.bin")])
    hub_bucket.api.download_bucket_files(hub_bucket.bucket_id, [("s.bin", tmp_path / "s.bin")])
    after = hub_bucket.hub.stats()

    def delta(route: str, key: str) -> int:
        return after["routes"][route][key] - before["routes"].get(route, {}).get(key, 0)

    assert delta("batch", "requests") == 1
    assert delta("xorb_upload", "bytes_in") >= len(data)  # random data: stored about as large
    assert delta("fetch", "bytes_out") >= len(data)
    assert delta("reconstruction", "requests") >= 1
    assert after["process_cpu_s"] >= before["process_cpu_s"] > 0


def test_dropped_resolve_read_is_retried_by_hffilesystem(
    hub_bucket: HubBucket, hub_faults: FaultControl
) -> None:
    from huggingface_hub import HfFileSystem

    data = os.urandom(200_000)
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(data, "d.bin")])
    hub_faults.add("resolve", drop=True, nth=1)
    fs = HfFileSystem(endpoint=hub_bucket.hub.endpoint, token=hub_bucket.hub.write_token)
    assert fs.cat_file(f"buckets/{hub_bucket.bucket_id}/d.bin", start=1000, end=150_000) == data[1000:150_000]
    assert _fired(hub_faults) == [1]


def test_a_stop_ends_a_request_held_in_a_fault_delay_within_its_grace() -> None:
    """A request in flight (held in a 600 s delay) holds a stop up twice STOP_GRACE_S at most (aiohttp
    waits that long for it, then as long for its cancellation); its client sees the connection close
    and the server's thread ends. Before, the stop waited for it
    until stop() gave up on the thread at 30 s (the session fixture's stop at each worker's end)."""
    secret = "hf_stopgrace_" + os.urandom(6).hex()
    with HubEmulator(tokens={"me": (secret, "write")}) as emu:
        emu.faults.add("whoami", latency_s=600)
        errors: list[BaseException] = []

        def call() -> None:
            req = urllib.request.Request(f"{emu.endpoint}/api/whoami-v2",
                                         headers={"Authorization": f"Bearer {secret}"})
            try:
                urllib.request.urlopen(req, timeout=60)
            except BaseException as e:  # what the client saw is the result
                errors.append(e)

        client = threading.Thread(target=call, daemon=True)
        client.start()
        end = time.monotonic() + 10
        while time.monotonic() < end and emu.faults.rules()[0]["seen"] < 1:
            time.sleep(0.02)
        assert emu.faults.rules()[0]["seen"] == 1
        server = emu._server._thread  # type: ignore[union-attr]
        t0 = time.monotonic()
        emu.stop()
        took = time.monotonic() - t0
        client.join(10)
        assert took < 2 * STOP_GRACE_S + 2.0, took
        assert server is not None and not server.is_alive()
        assert not client.is_alive() and len(errors) == 1, errors
        assert not isinstance(errors[0], urllib.error.HTTPError), errors  # closed, not answered
        emu.start()  # and it starts again on the same data
        again = urllib.request.Request(f"{emu.endpoint}/api/whoami-v2",
                                       headers={"Authorization": f"Bearer {secret}"})
        with urllib.request.urlopen(again, timeout=10) as r:
            assert json.loads(r.read())["name"] == "me"
