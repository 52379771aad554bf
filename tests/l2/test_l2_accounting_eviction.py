"""Partial store failures, eviction under a stream of stores, per-salt isolation, strict configs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvbucket.errors import ConfigError, TransientStoreError
from kvbucket.keys import ObjectKey, key_to_name
from kvbucket.l2 import EvictionConfig, ObjectStoreL2Adapter, open_l2_adapter, parse_l2_config
from kvbucket.metrics import InstrumentedStore
from kvbucket.stores.base import Buffer, ItemResult, ObjectInfo, ObjectStore, VersionedDelete
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing import l2 as t

CHUNK = 1024


def k(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("m", 1, i.to_bytes(4, "big"), salt)


def chunk(i: int) -> bytes:
    return bytes([i % 256]) * CHUNK


class FlakyStore(ObjectStore):
    """A non-transactional remote batch: per item, write and report an error ("lost ack"),
    drop and report an error, or write and succeed; the adapter must ask what landed."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = "flaky://"
        self.lost_ack: set[str] = set()
        self.dropped: set[str] = set()
        self.raise_whole_batch = False

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        keep = [(n, d) for n, d in items if n not in self.dropped]
        self.inner.put_many(keep)
        if self.raise_whole_batch:
            raise TransientStoreError("connection reset by peer")
        return [
            ItemResult(n, error=TransientStoreError("timeout"))
            if n in self.lost_ack | self.dropped
            else ItemResult(n, size=len(memoryview(d)))
            for n, d in items
        ]

    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        return self.inner.get_many(names, out)

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.head_many(names)

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return self.inner.delete_many(names)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, page_size=page_size)


def test_partly_failed_store_counts_exactly_what_landed() -> None:
    flaky = FlakyStore(MemoryStore())
    a = ObjectStoreL2Adapter(flaky, num_workers=2)
    try:
        keys = [k(i) for i in range(6)]
        flaky.lost_ack = {key_to_name(keys[1]), key_to_name(keys[4])}
        flaky.dropped = {key_to_name(keys[2])}
        res = t.store(a, keys, [chunk(i) for i in range(6)])
        assert not res.success
        assert res.landed == (True, True, False, True, True, True)
        assert res.bytes_stored == 5 * CHUNK
        assert a.get_usage().bytes_used == 5 * CHUNK
        # whole batch raised after writing: still counts what is there, once
        flaky.lost_ack, flaky.dropped = set(), {key_to_name(k(7))}
        flaky.raise_whole_batch = True
        res = t.store(a, [k(6), k(7), k(0)], [chunk(6), chunk(7), chunk(0)])
        assert res.landed == (True, False, True) and not res.success
        assert a.get_usage().bytes_used == 6 * CHUNK
        assert a.report_status()["store_failures"] == 2
    finally:
        a.close()


def test_deletes_subtract_only_what_was_removed() -> None:
    a = ObjectStoreL2Adapter(MemoryStore(), full_chunk_bytes=CHUNK)
    try:
        t.store(a, [k(1), k(2)], [chunk(1), chunk(2)])
        assert a.delete([k(1), k(3)]) == [True, True]  # k(3) never existed: removing it is a no-op
        assert a.get_usage().bytes_used == CHUNK
    finally:
        a.close()


def test_lru_eviction_keeps_usage_below_watermark_under_a_stream_of_stores() -> None:
    cap = 20 * CHUNK
    cfg = EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(MemoryStore(), max_capacity_bytes=cap, eviction=cfg, full_chunk_bytes=CHUNK)
    try:
        t.store(a, [k(0)], [chunk(0)])
        assert t.lookup(a, [k(0)]) == [True]  # k(0) stays locked: never evicted
        peak = 0
        for i in range(1, 120):
            t.store(a, [k(i)], [chunk(i)])
            if i % 7 == 0:
                t.lookup(a, [k(1)])  # k(1) is used often: recent, and locked too
            peak = max(peak, a.get_usage().bytes_used)
        a.delete([])  # a round trip through the loop: any running eviction pass has finished
        _settle(a)
        u = a.get_usage()
        assert u.bytes_used < 0.8 * cap
        assert peak <= 0.8 * cap + CHUNK  # one store may cross the watermark before eviction runs
        assert a.report_status()["evicted_keys"] >= 90
        hits = t.lookup(a, [k(0), k(1), k(2), k(119)])
        assert hits == [True, True, False, True]
        # usage agrees with what the store holds
        assert u.bytes_used == sum(info.size for info in a.store.list())
    finally:
        a.close()


def _settle(a: ObjectStoreL2Adapter) -> None:
    import time

    for _ in range(200):
        if not a.report_status()["inflight_tasks"] and not a._evicting:
            return
        time.sleep(0.01)


def test_one_tenants_churn_does_not_evict_another_within_its_share() -> None:
    cap = 40 * CHUNK  # target after eviction: (0.8 - 0.2) * 40 = 24 chunks; 2 tenants -> 12 each
    cfg = EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(MemoryStore(), max_capacity_bytes=cap, eviction=cfg, full_chunk_bytes=CHUNK)
    try:
        quiet = [k(i, "quiet") for i in range(10)]  # within its share of 12
        t.store(a, quiet, [chunk(i) for i in range(10)])
        for i in range(200):  # the noisy tenant churns
            t.store(a, [k(1000 + i, "noisy")], [chunk(i)])
        _settle(a)
        assert t.lookup(a, quiet) == [True] * 10
        by_salt = a.get_usage().bytes_by_cache_salt
        assert by_salt["quiet"] == 10 * CHUNK
        assert by_salt["noisy"] < 0.8 * cap - 10 * CHUNK + CHUNK
    finally:
        a.close()


def test_noop_policy_never_evicts_and_lru_without_a_capacity_is_refused() -> None:
    for cap, policy in ((4 * CHUNK, "noop"), (0, "noop")):
        cfg = EvictionConfig(eviction_policy=policy)
        a = ObjectStoreL2Adapter(MemoryStore(), max_capacity_bytes=cap, eviction=cfg, full_chunk_bytes=CHUNK)
        try:
            for i in range(10):
                t.store(a, [k(i)], [chunk(i)])
            _settle(a)
            assert a.get_usage().bytes_used == 10 * CHUNK
        finally:
            a.close()
    with pytest.raises(ConfigError, match="without a capacity"):  # issue 40 F7: never silent
        ObjectStoreL2Adapter(MemoryStore(), max_capacity_bytes=0, eviction=EvictionConfig())


# ---- strict configs ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"type": "fs", "base_path": "/tmp/x", "num_worker": 3}, "num_worker"),
        ({"type": "fs", "base_path": "/tmp/x", "num_workers": "8"}, "num_workers"),
        ({"type": "fs", "base_path": "/tmp/x", "fsync": "false"}, "fsync"),
        (
            {"type": "hfbucket", "bucket_handle": "hf://buckets/a/b", "create_bucket_if_missing": "false"},
            "create_bucket_if_missing",
        ),
        ({"type": "hfbucket"}, "bucket_handle"),
        ({"type": "s3", "s3_endpoint": "s3://b", "s3_region": "us-east-1", "disable_tls": 1}, "disable_tls"),
        (
            {"type": "fs", "base_path": "/x", "eviction": {"eviction_policy": "ARC"}},
            "eviction.eviction_policy",
        ),
        (
            {"type": "fs", "base_path": "/x", "eviction": {"eviction_policy": "LRU", "trigger_watermark": 2}},
            "eviction.trigger_watermark",
        ),
        ({"type": "fs", "base_path": "/x", "max_capacity_gb": True}, "max_capacity_gb"),
    ],
)
def test_strict_config_errors_name_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_l2_config(spec)
    assert repr(field) in str(e.value)


def test_config_errors_never_echo_secrets_and_reprs_hide_them() -> None:
    secret = "hf_SUPERSECRETTOKEN123"
    with pytest.raises(ConfigError) as e:
        parse_l2_config(
            {"type": "hfbucket", "bucket_handle": "hf://buckets/a/b", "token": secret, "num_workers": 0}
        )
    assert secret not in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_l2_config({"type": "hfbucket", "bucket_handle": "hf://buckets/a/b", "token": [secret]})
    assert secret not in str(e.value) and "'token'" in str(e.value)
    cfg = parse_l2_config({"type": "hfbucket", "bucket_handle": "hf://buckets/a/b", "token": secret})
    assert secret not in repr(cfg) and secret not in str(cfg.model_dump())


def test_bad_json_and_unknown_type() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_l2_config('{"type": "fs",')
    with pytest.raises(ConfigError, match=r"unknown L2 adapter type 'redis'.*fs, hfbucket, s3"):
        parse_l2_config({"type": "redis"})
    with pytest.raises(ConfigError, match="JSON object"):
        parse_l2_config("[1, 2]")


def test_open_fs_adapter_from_json(tmp_path) -> None:
    spec = (
        f'{{"type": "fs", "base_path": "{tmp_path / "kv"}", "num_workers": 2, "max_capacity_gb": 1, '
        '"eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}}'
    )
    with open_l2_adapter(spec) as a:
        assert t.store(a, [k(1)], [chunk(1)]).success
        assert a.get_usage().capacity_bytes == 1024**3
        assert isinstance(a.store.inner, InstrumentedStore) and isinstance(a.store.inner.inner, FileStore)
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700


def test_failed_overwrite_of_an_older_object_counts_the_old_one_not_the_new() -> None:
    inner = MemoryStore()
    inner.put(key_to_name(k(3)), b"x" * 10)  # an old object of another size under the same key
    flaky = FlakyStore(inner)
    a = ObjectStoreL2Adapter(flaky, full_chunk_bytes=CHUNK, rebuild_usage=False)
    try:
        flaky.dropped = {key_to_name(k(3))}
        res = t.store(a, [k(3)], [chunk(3)])
        assert res.landed == (False,) and res.bytes_stored == 0
        assert a.get_usage().bytes_used == 10  # what the store really holds under that name
        assert t.lookup(a, [k(3)]) == [False]  # not a full chunk: never a hit
    finally:
        a.close()


def test_two_controller_threads_at_once_keep_exact_accounting() -> None:
    """LMCache calls the adapter from a store controller and a prefetch controller at once."""
    import threading

    cfg = EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(MemoryStore(), num_workers=4, max_capacity_bytes=60 * CHUNK, eviction=cfg,
                             full_chunk_bytes=CHUNK)  # fmt: skip
    errors: list[BaseException] = []

    def storer() -> None:
        try:
            for i in range(150):
                t.store(a, [k(i % 90), k((i * 7) % 90, "s")], [chunk(i), chunk(i)])
        except BaseException as e:
            errors.append(e)

    def prefetcher() -> None:
        try:
            for i in range(150):
                keys = [k(i % 90), k((i + 3) % 90, "s")]
                hits = t.lookup(a, keys)
                bufs = [bytearray(CHUNK) for _ in keys]
                ok = t.load(a, keys, bufs)
                # a hit is locked until the unlock below, so eviction cannot take it before the load
                assert all(o for o, h in zip(ok, hits, strict=True) if h), (hits, ok)
                for b, good in zip(bufs, ok, strict=True):
                    if good:
                        assert b == bytes([b[0]]) * CHUNK  # never a torn or foreign buffer
                a.submit_unlock(keys)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        _settle(a)
        assert not errors, errors
        u = a.get_usage()
        assert u.bytes_used == sum(info.size for info in a.store.list())
        assert u.bytes_used < 0.8 * 60 * CHUNK + 2 * CHUNK
    finally:
        a.close()


def test_capacity_usage_and_evictions_are_exported_without_a_fleet() -> None:
    """Issue 31 item 13: an adapter with a capacity and eviction but no fleet exports its capacity,
    usage and evictions (the Grafana dashboard's capacity row), read from the registry as a scrape
    would; an adapter without a capacity exports none."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def scraped(url: str) -> dict[str, float]:
        text = generate_latest(REGISTRY).decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name.startswith("kvbucket_l2_") and s.labels.get("store") == url}

    cap = 20 * CHUNK
    cfg = EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(MemoryStore("gauges-capped"), max_capacity_bytes=cap, eviction=cfg,
                             full_chunk_bytes=CHUNK)
    plain = ObjectStoreL2Adapter(MemoryStore("gauges-uncapped"), full_chunk_bytes=CHUNK)
    try:
        for i in range(40):
            t.store(a, [k(i)], [chunk(i)])
        t.store(plain, [k(0)], [chunk(0)])
        a.delete([])
        _settle(a)
        got = scraped(a.store.url)
        assert got["kvbucket_l2_capacity_bytes"] == cap
        assert got["kvbucket_l2_bytes_used"] == a.get_usage().bytes_used > 0
        assert got["kvbucket_l2_evictions_total"] == a.report_status()["evicted_keys"] > 0
        assert got["kvbucket_l2_evicted_bytes_total"] == a.report_status()["evicted_bytes"] > 0
        assert scraped(plain.store.url) == {}
    finally:
        a.close()
        plain.close()
    assert scraped(a.store.url) == {}  # a closed adapter drops out


def test_a_capacity_without_an_eviction_setting_is_enforced(tmp_path) -> None:
    """Issue 40: ``max_capacity_gb`` alone (no ``"eviction"``) evicts with the documented default
    (LRU, watermark 0.8, ratio 0.2): 20 x 64 KiB into 0.2 MB keeps the directory under 0.2 MB."""
    size = 64 * 1024
    cap_gb = 0.2e6 / 1024**3
    spec = {"type": "fs", "base_path": str(tmp_path / "kv"), "max_capacity_gb": cap_gb}
    with open_l2_adapter(spec) as a:
        assert a.report_status()["eviction_policy"] == "LRU"
        cap = a.get_usage().capacity_bytes
        for i in range(20):
            assert t.store(a, [k(i)], [bytes([i]) * size]).success
            a.delete([])  # a round trip through the loop: the eviction pass this store started ended
            _settle(a)
            on_disk = sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*") if f.is_file())
            assert on_disk <= cap, f"after {i + 1} stores: {on_disk} bytes in a {cap}-byte capacity"
        assert a.report_status()["evicted_keys"] >= 16
        assert t.lookup(a, [k(19)]) == [True]
    # unbounded stays unbounded; "noop" turns eviction off explicitly
    with open_l2_adapter({**spec, "max_capacity_gb": 0}) as a:
        assert a.report_status()["eviction_policy"] is None
    noop = {**spec, "base_path": str(tmp_path / "kv2"), "eviction": {"eviction_policy": "noop"}}
    with open_l2_adapter(noop) as a:
        for i in range(5):
            t.store(a, [k(i)], [bytes([i]) * size])
        assert a.get_usage().bytes_used == 5 * size


def test_close_during_an_eviction_pass_leaves_no_pending_task(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 40: closing an adapter while its eviction pass waits on a delete once logged asyncio's
    "Task was destroyed but it is pending! ... RemovalPath._evict()"."""
    import gc
    import logging
    import threading
    import time

    gate, entered = threading.Event(), threading.Event()

    class SlowDeletes(MemoryStore):
        def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
            entered.set()  # eviction deletes the versions it judged (issue 39)
            gate.wait(3)
            return super().delete_versions(items)

    a = ObjectStoreL2Adapter(SlowDeletes(), max_capacity_bytes=10 * CHUNK, full_chunk_bytes=CHUNK,
                             delete_timeout_secs=0.5)
    for i in range(10):
        t.store(a, [k(i)], [chunk(i)])
    assert entered.wait(10), "no eviction pass started"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        a.close()
        gate.set()  # the delete returns after close gave up waiting for it
        time.sleep(0.3)
        del a
        gc.collect()
    assert "Task was destroyed" not in caplog.text, caplog.text


def test_report_status_moves_an_outages_error_to_history_once_the_store_answers() -> None:
    """Issue 40 (soak): after an outage report_status() kept its last_error next to
    ``is_healthy: true``; the error of now is None once a store call fully succeeded after it."""

    class Outage(MemoryStore):
        down = False

        def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
            if self.down:
                raise TransientStoreError("connection reset by peer")
            return super().put_many(items)

        def head_many(self, names: Sequence[str]) -> list[ItemResult]:
            if self.down:
                raise TransientStoreError("connection reset by peer")
            return super().head_many(names)

    store = Outage()
    a = ObjectStoreL2Adapter(store, full_chunk_bytes=CHUNK)
    try:
        assert (a.report_status()["last_error"], a.report_status()["last_error_at"]) == (None, None)
        store.down = True
        assert not t.store(a, [k(1)], [chunk(1)]).success
        down = a.report_status()
        assert "connection reset by peer" in down["last_error"] and down["previous_error"] is None
        assert down["last_error_at"] is not None
        store.down = False
        assert t.store(a, [k(2)], [chunk(2)]).success
        up = a.report_status()
        assert up["is_healthy"] and up["last_error"] is None
        assert "connection reset by peer" in up["previous_error"]
        assert up["last_error_at"] == down["last_error_at"]
    finally:
        a.close()
