"""``kvbucket migrate``: LMCache-format chunks become sealed kvbucket chunks, resumably.

LMCache 0.5.6's own ``fs`` adapter writes the chunks the CLI migrates; kvbucket's adapter with
default settings (unsealed objects under its names are misses) then reads every one, bytes
checked, which shows they were sealed. The library tests run the Hub bucket's names (written by
kvbucket's adapter in LMCache's format) and a run that fails half-way, then is run again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

from kvbucket.integrations.lmcache import to_kvbucket_key
from kvbucket.keys import ObjectKey
from kvbucket.l2 import ObjectStoreL2Adapter, open_l2_adapter
from kvbucket.l2.migrate import migrate, plan
from kvbucket.l2.naming import Naming
from kvbucket.stores.base import ItemResult
from kvbucket.stores.guard.sealed import SealedStore
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing import l2 as t

N = 5
CHUNK = 4096


def lm_keys() -> list[LMKey]:
    return [LMKey(chunk_hash=i.to_bytes(16, "big"), model_name="org/model", kv_rank=0) for i in range(N)]


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(CHUNK))


def lmcache_fills(path: Path) -> None:
    """LMCache's own fs adapter stores N chunks in ``path``."""
    a = FSL2Adapter(FSL2AdapterConfig(base_path=str(path)))
    try:
        tid = a.submit_store_task(lm_keys(), [t.lmcache_memory_obj(payload(i)) for i in range(N)])
        assert t.wait_fd(a.get_store_event_fd())
        assert a.pop_completed_store_tasks()[tid]
    finally:
        a.close()


def read_all(adapter: ObjectStoreL2Adapter, keys: list[ObjectKey]) -> list[bytes | None]:
    bufs = [bytearray(CHUNK) for _ in keys]
    ok = t.load(adapter, keys, bufs)
    return [bytes(b) if hit else None for b, hit in zip(bufs, ok, strict=True)]


def test_cli_migrates_lmcache_fs_chunks_and_finishes_an_interrupted_run(tmp_path: Path) -> None:
    d = tmp_path / "kv"
    lmcache_fills(d)
    (d / "notes.txt").write_text("not a chunk")  # foreign: left alone
    data_files = sorted(p.name for p in d.iterdir() if p.suffix == ".data")
    assert len(data_files) == N

    r = run_cli("migrate", str(d), "--dry-run")
    assert r.code == 0, r.err
    assert f"{N} LMCache-format objects" in r.out
    assert sorted(p.name for p in d.iterdir() if p.suffix == ".data") == data_files

    # A run stopped after writing two sealed chunks, before deleting their sources.
    with FileStore(d) as store:
        naming = Naming(style="fs")
        moves = plan(store, naming)
        rep = migrate(store, naming, moves[:2], keep_source=True)
        assert (rep.written, rep.deleted) == (2, 0)

    r = run_cli("migrate", str(d))
    assert r.code == 0, (r.out, r.err)
    assert f"wrote {N - 2} sealed chunks" in r.out and "2 were already there" in r.out
    assert f"removed {N} LMCache-format objects" in r.out
    assert not [p for p in d.iterdir() if p.suffix == ".data"]
    assert (d / "notes.txt").read_text() == "not a chunk"

    keys = [to_kvbucket_key(k) for k in lm_keys()]
    with open_l2_adapter({"type": "fs", "base_path": str(d)}) as a:  # unsealed would be misses
        assert read_all(a, keys) == [payload(i) for i in range(N)]
        assert a.wait_until_rebuilt(10) and a.get_usage().bytes_used == N * CHUNK

    r = run_cli("migrate", str(d))  # nothing left
    assert r.code == 0 and "0 LMCache-format objects" in r.out


def test_cli_migrate_errors(tmp_path: Path) -> None:
    runs = [("migrate", str(tmp_path / "missing")), ("migrate", str(tmp_path), "--connector"),
            ("migrate", str(tmp_path), "--from", "gcs"), ("migrate", "--help")]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # four CLI starts: two at a time
        missing, connector, unknown, shown = pool.map(lambda args: run_cli(*args), runs)
    assert_one_line_error(missing, 2, "missing")
    assert_one_line_error(connector, 2, "--from", "hfbucket, s3")
    assert_one_line_error(unknown, 2, "fs, hfbucket, s3")
    assert shown.code == 0 and "--keep-source" in shown.out and "--dry-run" in shown.out


def names(store: MemoryStore) -> list[str]:
    return [i.name for i in store.list()]


class FailingPuts(MemoryStore):
    """A store whose writes of some names fail (as an interrupted or refused upload would)."""

    def __init__(self, fail: set[str]) -> None:
        super().__init__("l2")
        self.fail = fail

    def put_many(self, items: Any) -> list[ItemResult]:
        items = list(items)
        ok = super().put_many([it for it in items if it[0] not in self.fail])
        by_name = {r.name: r for r in ok}
        return [by_name.get(n) or ItemResult(n, error=OSError("refused")) for n, _ in items]  # type: ignore[arg-type]


def test_hub_bucket_names_migrate_and_a_failed_chunk_is_retried_by_the_next_run() -> None:
    keys = [ObjectKey("org/model", 0, i.to_bytes(8, "big")) for i in range(N)]
    hub_naming = Naming(style="hfbucket")
    failing = hub_naming.kvbucket_name(keys[1])
    store = FailingPuts({failing})
    lm = ObjectStoreL2Adapter(
        store, owns_store=False, naming=Naming(style="hfbucket", object_format="lmcache")
    )
    assert t.store(lm, keys, [payload(i) for i in range(N)]).success
    lm.close()
    assert sorted(names(store)) == sorted(hub_naming.lmcache_name(k) for k in keys)

    rep = migrate(store, hub_naming, plan(store, hub_naming))
    assert (rep.written, rep.deleted) == (N - 1, N - 1)
    assert [name for name, _ in rep.failed] == [hub_naming.lmcache_name(keys[1])]
    assert hub_naming.lmcache_name(keys[1]) in names(store)  # its source is kept

    store.fail.clear()
    rep = migrate(store, hub_naming, plan(store, hub_naming))
    assert (rep.found, rep.written, rep.deleted, rep.failed) == (1, 1, 1, [])
    assert sorted(names(store)) == sorted(hub_naming.kvbucket_name(k) for k in keys)
    sealed = SealedStore(store, tier="l2")
    assert [bytes(r.data) for r in sealed.get_many([hub_naming.kvbucket_name(k) for k in keys])] == [
        payload(i) for i in range(N)
    ]
