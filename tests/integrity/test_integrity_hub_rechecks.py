"""The Hub's compare-to-delete window, and how a writer closes it (issue 39; stores/hub/rechecks.py).

The Hub's bucket API deletes with no condition (huggingface_hub's ``deleteFile`` names a path,
nothing else; the emulator behaves alike), so a write committed between a deleter's paths-info
compare and its ``deleteFile`` batch is removed. Here a hook runs exactly there, in the
deleter's store: a writer commits a new version. The delete takes it (the window is real), then
the writer's re-check, ``recheck_delay_secs`` after its commit, adds it back by its Xet hash.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbucket.errors import ConfigError
from kvbucket.stores.guard.refusals import delete_as_seen
from kvbucket.stores.guard.sealed import SealedStore, seal_store
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.rechecks import HUB_DELETE_WINDOW, HUB_RECHECKS
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.testing.delete_races import damage

WINDOW, DELAY = 2.0, 2.5  # the test's settings (defaults 2 and 5): a shorter wait for the re-check


def count(counter: Any, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


@pytest.fixture
def open_hub(hub_bucket: Any) -> Iterator[Callable[..., HFBucketStore]]:
    opened: list[HFBucketStore] = []

    def open_store(**kw: Any) -> HFBucketStore:
        cfg = HFBucketConfig(**{
            "bucket_handle": f"hf://buckets/{hub_bucket.bucket_id}/kv", "token": hub_bucket.hub.write_token,
            "endpoint": hub_bucket.hub.endpoint, "metadata_cache_ttl_secs": 0,
            "delete_window_secs": WINDOW, "recheck_delay_secs": DELAY, **kw})
        opened.append(HFBucketStore(cfg))
        return opened[-1]

    yield open_store
    for s in opened:
        s.close()


def between_compare_and_delete(store: HFBucketStore, hook: Callable[[list[str]], Any]) -> list[list[str]]:
    """Run ``hook(paths)`` once in ``store``'s delete by version, after its compare and right
    before its ``deleteFile`` batch is sent; the paths it ran before are recorded."""
    real = store._delete_batch
    ran: list[list[str]] = []

    def hooked(chunk: list[str], deadline: float) -> Any:
        if not ran:
            ran.append(list(chunk))
            hook(chunk)
        return real(chunk, deadline)

    store._delete_batch = hooked  # type: ignore[method-assign]
    return ran


def refusal(reader: SealedStore, _raw: HFBucketStore, name: str) -> None:
    assert reader.get(name) is None  # v1 judged damaged twice: a miss, removed by version


def verify_delete_bad(_reader: SealedStore, raw: HFBucketStore, name: str) -> None:
    from kvbucket.cli.verify_cmd import remove_damaged

    assert remove_damaged(raw, [name], None, {}) == (1, 0)


def eviction(_reader: SealedStore, raw: HFBucketStore, name: str) -> None:
    (h,) = raw.head_many([name])
    (r,) = delete_as_seen(raw, [name], {name: h.version}, "eviction").values()
    assert r.removed


def fleet_eviction(_reader: SealedStore, raw: HFBucketStore, name: str) -> None:
    (r,) = delete_as_seen(raw, [name], {}, "fleet_eviction").values()  # the version a HEAD sees
    assert getattr(r, "removed", False)


def rm_identity(_reader: SealedStore, raw: HFBucketStore, name: str) -> None:
    from kvbucket.cli.store_cmd import _delete

    ((listed, version),) = [(i.name, i.version) for i in raw.list(name)]
    (r,) = _delete(raw, [listed], {listed: version})
    assert r.removed


@pytest.mark.parametrize("delete", [refusal, verify_delete_bad, eviction, fleet_eviction, rm_identity])
def test_a_version_committed_between_compare_and_delete_is_added_back(
    open_hub: Callable[..., HFBucketStore], delete: Callable[[SealedStore, HFBucketStore, str], None],
) -> None:
    v1, v2 = os.urandom(3000), os.urandom(3000)
    writer = seal_store(open_hub(), tier="w", identity="rc")
    deleter_raw = open_hub()
    deleter = seal_store(deleter_raw, tier="hub-recheck", identity="rc")
    writer.put("n", v1)
    damage(writer.inner, "n")  # a damaged v1 in storage (a new version: the writer's own put)
    ran = between_compare_and_delete(deleter_raw, lambda paths: writer.put("n", v2))
    readded = count(HUB_RECHECKS, "readded")
    t0 = time.monotonic()
    delete(deleter, deleter_raw, "n")
    assert ran == [["kv/n"]]  # the writer committed v2 after the compare, before the batch
    check = open_hub(recheck_delay_secs=0)
    assert check.head_many(["n"])[0].size is None  # the window is real: the delete took v2
    assert writer.inner.rechecks.settle() >= 1  # due recheck_delay_secs after v2's commit
    assert time.monotonic() - t0 < DELAY + 5
    assert count(HUB_RECHECKS, "readded") == readded + 1
    assert seal_store(check, tier="c", identity="rc").get("n") == v2  # added back, its bytes


def test_a_newer_version_is_left_alone_and_a_kept_one_counted(open_hub: Callable[..., HFBucketStore]) -> None:
    a, b = open_hub(), open_hub()
    a.put_many([("x", b"from a"), ("y", b"from a too")])
    b.put("x", b"from b, newer")
    newer, kept = count(HUB_RECHECKS, "newer"), count(HUB_RECHECKS, "kept")
    assert a.rechecks.settle() == 2
    assert count(HUB_RECHECKS, "newer") == newer + 1 and count(HUB_RECHECKS, "kept") == kept + 1
    assert a.get("x") == b"from b, newer" and a.get("y") == b"from a too"


def test_this_stores_own_delete_is_not_undone(open_hub: Callable[..., HFBucketStore]) -> None:
    s = open_hub()
    s.put_many([("gone-by-name", b"1"), ("gone-by-version", b"2")])
    (h,) = s.head_many(["gone-by-version"])
    assert s.delete_many(["gone-by-name"])[0].ok
    assert s.delete_versions([("gone-by-version", h.version or "")])[0].removed
    assert len(s.rechecks) == 0
    assert s.rechecks.settle() == 0
    assert s.head_many(["gone-by-name", "gone-by-version"])[0].size is None


def test_an_rm_from_elsewhere_soon_after_a_write_comes_back(open_hub: Callable[..., HFBucketStore]) -> None:
    """The documented consequence: a name removed less than recheck_delay_secs after a running
    writer committed it comes back with that writer's bytes (docs/hfbucket.md)."""
    writer, other = open_hub(), open_hub()
    writer.put("n", b"just written")
    assert other.delete_many(["n"])[0].ok
    writer.rechecks.settle()
    assert other.get("n") == b"just written"


def test_close_runs_the_pending_checks_at_once(open_hub: Callable[..., HFBucketStore]) -> None:
    writer, other = open_hub(), open_hub()
    writer.put_many([("n", b"v"), ("m", b"w")])
    assert other.delete_many(["n"])[0].ok
    t0 = time.monotonic()
    writer.close()
    assert time.monotonic() - t0 < DELAY  # it did not wait until the checks were due
    assert other.get("n") == b"v" and other.get("m") == b"w"


def test_off_costs_nothing_and_leaves_the_window_open(open_hub: Callable[..., HFBucketStore]) -> None:
    writer, other = open_hub(recheck_delay_secs=0), open_hub()
    writer.put("n", b"v")
    assert len(writer.rechecks) == 0 and writer.rechecks._thread is None
    assert other.delete_many(["n"])[0].ok
    t0 = time.monotonic()
    writer.close()
    assert time.monotonic() - t0 < 2 and other.get("n") is None


def test_a_slow_compare_is_made_again(open_hub: Callable[..., HFBucketStore]) -> None:
    """The deleter's side of the bound: a compare whose answer comes later than half of
    delete_window_secs is asked again before the delete is sent."""
    s = open_hub(delete_window_secs=0.4, recheck_delay_secs=1.0)
    s.put("n", b"v")
    (h,) = s.head_many(["n"])
    real, calls = s._client.paths_info, []

    def slow_once(paths: Any, deadline: Any = None) -> Any:
        calls.append(paths)
        if len(calls) == 1:
            time.sleep(0.3)
        return real(paths, deadline)

    s._client.paths_info = slow_once  # type: ignore[method-assign]
    before = count(HUB_DELETE_WINDOW, "recompared")
    assert s.delete_versions([("n", h.version or "")])[0].removed
    assert len(calls) == 2 and count(HUB_DELETE_WINDOW, "recompared") == before + 1


def test_the_delay_must_outlast_the_window() -> None:
    with pytest.raises((ConfigError, ValueError), match="recheck_delay_secs=1 must be longer than"):
        HFBucketConfig(bucket_handle="hf://buckets/a/b", recheck_delay_secs=1, delete_window_secs=2)
    HFBucketConfig(bucket_handle="hf://buckets/a/b", recheck_delay_secs=0, delete_window_secs=2)  # off


def test_a_fleet_on_the_hub_evicts_nothing_younger_than_twice_the_delay(
    open_hub: Callable[..., HFBucketStore], tmp_path: Any,
) -> None:
    """Else a writer's re-check adds back what the fleet evicted, and the fleet counts it gone."""
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.fleet.sync import Fleet, recheck_delay
    from kvbucket.stores.local.file import FileStore

    hub = seal_store(open_hub(), tier="f", identity="rc")
    assert recheck_delay(hub) == DELAY and recheck_delay(open_hub(recheck_delay_secs=0)) == 0
    assert recheck_delay(FileStore(tmp_path)) == 0
    fleet = Fleet(hub, FleetConfig(node_id="g", grace_secs=1.0), prefix="p")
    try:
        assert fleet._grace == 2 * DELAY
    finally:
        fleet.close()


def test_close_with_checks_pending_and_a_hung_hub_ends_within_its_bound() -> None:
    """close() runs the pending checks, within DEFAULT_CLOSE_TIMEOUT_SECS: a Hub that does not
    answer does not hold it (the checks are counted failed)."""
    from kvbucket.stores.base import ItemResult
    from kvbucket.testing.silent_server import SilentServer
    from kvbucket.threads import DEFAULT_CLOSE_TIMEOUT_SECS

    with SilentServer() as server:
        store = HFBucketStore(HFBucketConfig(bucket_handle="hf://buckets/o/hung", token="hf_x",
                                             token_env="", endpoint=server.url))
        store.rechecks.committed(["n"], [ItemResult("n", size=1, version="ab" * 32)], 0)
        failed = count(HUB_RECHECKS, "failed")
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < DEFAULT_CLOSE_TIMEOUT_SECS + 2
        assert count(HUB_RECHECKS, "failed") == failed + 1
