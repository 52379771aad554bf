"""Metrics: instrumented backend/store wrappers, the /metrics endpoint, `kvbucket stats`."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from kvbucket.cli import build_app
from kvbucket.keys import CacheEngineKey
from kvbucket.metrics import InstrumentedBackend, InstrumentedStore, start_metrics_server, summarize
from kvbucket.stores.base import Revision
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.dict_backend import DictBackend as _DictBackend


class DictBackend(_DictBackend):
    """Puts of exactly 13 bytes fail, so error counters have something to count."""

    def put(self, key, chunk, blocking=True):  # type: ignore[no-untyped-def]
        if len(memoryview(chunk).cast("B")) == 13:
            raise OSError("13 bytes are unlucky")
        super().put(key, chunk, blocking)


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i, "float32")


def test_instrumented_backend_counts_hits_misses_bytes_and_errors() -> None:
    tier = "t-backend"
    b = InstrumentedBackend(DictBackend(), tier)
    b.put(key(1), b"x" * 100)
    assert b.batched_put([(key(2), b"y" * 50), (key(3), b"z" * 13)]) == 1  # the 13-byte one fails
    assert b.get(key(1)) == b"x" * 100
    assert b.batched_get([key(2), key(9)]) == [b"y" * 50, None]
    assert b.contains(key(1)) and not b.contains(key(9))
    assert b.batched_contains([key(1), key(2), key(9)]) == [True, True, False]
    with pytest.raises(OSError):
        b.put(key(4), b"q" * 13)
    assert b.remove(key(1)) and not b.remove(key(1))
    ops = "kvbucket_backend_operations_total"
    assert value(ops, tier=tier, op="get", result="hit") == 2
    assert value(ops, tier=tier, op="get", result="miss") == 1
    assert value(ops, tier=tier, op="put", result="ok") == 2
    assert value(ops, tier=tier, op="put", result="error") == 2
    assert value(ops, tier=tier, op="contains", result="hit") == 3
    assert value(ops, tier=tier, op="contains", result="miss") == 2
    assert value(ops, tier=tier, op="remove", result="ok") == 1
    assert value("kvbucket_backend_bytes_total", tier=tier, direction="read") == 150
    # the failed batch item is not counted as written; the one that landed is
    assert value("kvbucket_backend_bytes_total", tier=tier, direction="write") == 150
    assert value("kvbucket_backend_latency_seconds_count", tier=tier, op="get") == 1
    assert value("kvbucket_backend_latency_seconds_count", tier=tier, op="batched_get") == 1


def test_instrumented_store_counts_objects_and_bytes() -> None:
    s = InstrumentedStore(MemoryStore(), name="t-store")
    assert s.name == "t-store"
    s.put_many([("a", b"1234"), ("b", b"12")])
    got = s.get_many(["a", "missing"])
    assert got[0].data is not None and bytes(got[0].data) == b"1234" and got[1].size is None
    assert [r.size for r in s.head_many(["b", "nope"])] == [2, None]
    s.delete_many(["a"])
    objs = "kvbucket_store_objects_total"
    assert value(objs, store="t-store", op="put", result="ok") == 2
    assert value(objs, store="t-store", op="get", result="hit") == 1
    assert value(objs, store="t-store", op="get", result="miss") == 1
    assert value(objs, store="t-store", op="head", result="miss") == 1
    assert value(objs, store="t-store", op="delete", result="ok") == 1
    assert value("kvbucket_store_bytes_total", store="t-store", direction="write") == 6
    assert value("kvbucket_store_bytes_total", store="t-store", direction="read") == 4
    assert [o.name for o in s.list()] == ["b"]


def test_instrumented_store_counts_conditional_and_object_by_object_reads(tmp_path: Path) -> None:
    """The wrapper keeps a store's own conditional read (one small request when unchanged; the
    base class's would read the whole object) and its object-by-object reads (``get_each``, which
    the sealing layer's encrypted loads use on a directory), counting both."""
    asked: list[tuple[str, str | None]] = []

    class Tagged(MemoryStore):
        def get_if_changed(self, name: str, tag: str | None) -> Revision:
            asked.append((name, tag))
            data = self.get(name)
            return Revision(None) if data is None else Revision("v1", None if tag == "v1" else data)

    s = InstrumentedStore(Tagged(), name="t-cond")
    s.put("a", b"12345")
    assert s.get_if_changed("a", None) == Revision("v1", b"12345")
    assert s.get_if_changed("a", "v1") == Revision("v1")
    assert s.get_if_changed("gone", "v1") == Revision(None)
    assert asked == [("a", None), ("a", "v1"), ("gone", "v1")]  # the store's own, each time
    objs = "kvbucket_store_objects_total"
    results = ("hit", "unchanged", "miss")
    assert [value(objs, store="t-cond", op="get_if_changed", result=r) for r in results] == [1, 1, 1]
    assert value("kvbucket_store_bytes_total", store="t-cond", direction="read") == 5
    assert not hasattr(s, "get_each")  # only where the inner store has it

    d = InstrumentedStore(FileStore(tmp_path), name="t-each")
    d.put_many([("x", b"abc"), ("y", b"de")])
    seen: list[int] = []
    got = d.get_each(["x", "y", "z"], None, lambda i, r: seen.append(i) or r)  # type: ignore[attr-defined]
    assert seen == [0, 1, 2] and [r.size for r in got] == [3, 2, None]
    assert [value(objs, store="t-each", op="get", result=r) for r in ("hit", "miss")] == [2, 1]
    assert value("kvbucket_store_bytes_total", store="t-each", direction="read") == 5


def test_summary_over_http_and_kvbucket_stats() -> None:
    b = InstrumentedBackend(DictBackend(), "t-http")
    b.put(key(1), b"a" * 2048)
    b.get(key(1))
    b.get(key(2))
    with start_metrics_server(0) as server:
        assert server.port > 0 and server.addr == "127.0.0.1"
        result = CliRunner(env={"COLUMNS": "200"}).invoke(build_app(), ["stats", "--url", server.url])
        assert result.exit_code == 0, result.output
        assert "t-http" in result.output and "50%" in result.output and "2.0 KiB" in result.output
        import urllib.request

        with urllib.request.urlopen(server.url) as resp:
            rows = {r.name: r for r in summarize(resp.read().decode()).rows}
    row = rows["t-http"]
    assert (row.hits, row.misses, row.writes, row.bytes_read) == (1, 1, 1, 2048)
    assert row.hit_ratio == 0.5 and row.mean_read_ms is not None


def test_stats_says_what_is_wrong_with_the_url() -> None:
    runner = CliRunner()
    result = runner.invoke(build_app(), ["stats", "--url", "ftp://x/metrics"])
    assert result.exit_code != 0 and "not an http(s) URL" in result.output
    with start_metrics_server(0) as server:
        port = server.port
    result = runner.invoke(build_app(), ["stats", "--url", f"http://127.0.0.1:{port}/metrics"])
    assert result.exit_code != 0 and "cannot reach" in result.output
