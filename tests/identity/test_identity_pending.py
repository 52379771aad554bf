"""While a model directory's weights are hashed for the first time on a machine, its identity is
*not known yet* (IdentityPending): lookups and reads miss, stores are dropped and counted, and
nothing is ever written under a guessed name (nor a name-only one). Then it is known, and every
name carries it. The hashing is held on an event here, so the window is as long as the test wants."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.identity import weights as weights_mod
from kvbucket.identity.core import IdentityPending, IdentitySetting, identity_of_dir, split_key_string
from kvbucket.keys import name_to_key
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key
from kvbucket.testing.identity_models import make_model_dirs

LAYOUT = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[threading.Event]:
    """Weight hashing waits for the returned event (a slow first computation)."""
    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    go = threading.Event()
    real = weights_mod.hash_files

    def slow(sizes):  # type: ignore[no-untyped-def]
        assert go.wait(30)
        return real(sizes)

    monkeypatch.setattr(weights_mod, "hash_files", slow)
    yield go
    go.set()


def chunk_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and "@" in p.name)


def test_the_setting_says_not_known_yet_until_the_hash_is_done(tmp_path: Path, held: threading.Event) -> None:
    d = make_model_dirs(tmp_path / "models")["base"]
    setting = IdentitySetting(str(d))
    assert bool(setting) and not setting.ready() and setting.unknown(3)
    with pytest.raises(IdentityPending):
        setting.token("org/llama")
    with pytest.raises(IdentityPending):
        identity_of_dir(d, wait=False)
    assert setting.pending_counts() == {"misses": 3, "refused": 1}
    held.set()
    assert setting.wait(30) and setting.ready() and not setting.unknown(5)
    assert setting.token("org/llama") == identity_of_dir(d, "org/llama").token


def test_remote_tier_misses_and_drops_until_known_then_names_by_it(tmp_path: Path,
                                                                   held: threading.Event) -> None:
    d = make_model_dirs(tmp_path / "models")["base"]
    root = tmp_path / "kv"
    keys = [key(i) for i in range(3)]
    data = [chunk_bytes(LAYOUT, i) for i in range(3)]
    with RemoteBackend(FileStore(root), LAYOUT, model_identity=str(d)) as tier:
        assert tier.batched_contains(keys) == [False] * 3 and tier.batched_get(keys) == [None] * 3
        results = tier.batched_put_results(list(zip(keys, data, strict=True)))
        assert all(isinstance(r, IdentityPending) for r in results)
        results = tier.batched_put_results(list(zip(keys, data, strict=True)), blocking=False)
        assert all(isinstance(r, IdentityPending) for r in results)
        assert tier.list() == [] and chunk_files(root) == []  # nothing written, under any name
        assert tier.report_status()["identity_pending"] == {"misses": 6, "refused": 6}
        held.set()
        assert tier._identity.wait(30)
        tier.batched_put(list(zip(keys, data, strict=True)))
        assert [as_bytes(c) for c in tier.batched_get(keys)] == data
    token = identity_of_dir(d, keys[0].model_name).token
    names = chunk_files(root)
    assert len(names) == 3 and {split_key_string(name_to_key(n))[1] for n in names} == {token}


def test_l2_adapter_misses_and_drops_until_known(tmp_path: Path, held: threading.Event) -> None:
    """The L2 adapter LMCache's plugin wraps (``open_l2_adapter``, as ``adapter_params``)."""
    from kvbucket.keys import ObjectKey
    from kvbucket.l2.registry import open_l2_adapter
    from kvbucket.testing import l2 as t

    d = make_model_dirs(tmp_path / "models")["base"]
    root = tmp_path / "kv"
    keys = [ObjectKey("org/llama", 1, bytes([i + 1]) * 16) for i in range(5)]
    data = [bytes([i + 7]) * 4096 for i in range(5)]
    adapter = open_l2_adapter({"type": "fs", "base_path": str(root), "model_identity": str(d)})
    try:
        assert t.lookup(adapter, keys) == [False] * 5
        assert t.load(adapter, keys, [bytearray(4096) for _ in keys]) == [False] * 5
        assert not t.store(adapter, keys, data).success and chunk_files(root) == []
        status = adapter.report_status()["identity_pending"]
        assert status["misses"] >= 10 and status["refused"] == 5
        held.set()
        assert adapter.naming.identity.wait(30)
        assert t.store(adapter, keys, data).success
        assert t.lookup(adapter, keys) == [True] * 5
        bufs = [bytearray(4096) for _ in keys]
        assert t.load(adapter, keys, bufs) == [True] * 5 and [bytes(b) for b in bufs] == data
        adapter.submit_unlock(keys)
    finally:
        adapter.close()
    token = identity_of_dir(d, "org/llama").token
    assert len(chunk_files(root)) == 5 and all(f"~{token}@" in n for n in chunk_files(root))


def test_lmcache_connector_misses_and_drops_until_known(tmp_path: Path, held: threading.Event,
                                                        lm_loop: object) -> None:
    """LMCache's non-MP connector (its engine config, metadata and CPU backend)."""
    pytest.importorskip("lmcache", reason="the lmcache extra is not installed")
    import asyncio

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvbucket.integrations.lmcache import KVBucketConnector

    d = make_model_dirs(tmp_path / "models")["base"]
    root = tmp_path / "kv"
    pre = "remote_storage_plugin.kv."
    extra = {pre + "module_path": "kvbucket.integrations.lmcache", pre + "class_name": "KVBucketConnector",
             pre + "bucket_handle": f"file://{root}", pre + "model_identity": str(d)}
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=False, max_local_cpu_size=0.05,
                                            remote_serde="naive", remote_storage_plugins=["kv"],
                                            extra_config=extra)
    md = LMCacheMetadata(model_name="org/llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 64),
                         chunk_size=16)
    cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
    conn = KVBucketConnector(loop=lm_loop, local_cpu_backend=cpu, config=cfg)
    keys = [CacheEngineKey("org/llama", 1, 0, h, torch.bfloat16) for h in range(0x100, 0x105)]

    def run(coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, lm_loop).result(30)  # type: ignore[arg-type]

    def put_all() -> None:
        for i, k in enumerate(keys):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.raw_data.view(torch.uint8).fill_(i + 1)
            run(conn.put(k, obj))

    def hits() -> int:
        got = [o for o in run(conn.batched_get(keys)) if o is not None]
        for o in got:
            o.ref_count_down()
        return min(run(conn.batched_async_contains("t", keys)), len(got))

    try:
        assert hits() == 0
        put_all()  # dropped, counted: nothing written under any name
        assert chunk_files(root) == [] and run(conn.list()) == []
        assert conn.naming.identity.pending_counts()["refused"] == 5
        held.set()
        assert conn.naming.identity.wait(30)
        put_all()
        assert hits() == 5
    finally:
        run(conn.close())
    token = identity_of_dir(d, "org/llama").token
    assert len(chunk_files(root)) == 5 and all(f"~{token}@" in n for n in chunk_files(root))


def test_an_unreadable_weight_file_is_never_a_guessed_identity(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashing fails (a file unreadable): still not known, a miss; ``wait`` says what is wrong."""
    from kvbucket.errors import ConfigError

    monkeypatch.setenv("KVBUCKET_IDENTITY_CACHE", str(tmp_path / "cache.json"))
    def unreadable(sizes):  # type: ignore[no-untyped-def]
        raise PermissionError("denied")

    monkeypatch.setattr(weights_mod, "hash_files", unreadable)
    d = make_model_dirs(tmp_path / "models")["base"]
    setting = IdentitySetting(str(d))
    with pytest.raises(ConfigError, match=r"cannot be computed.*denied"):
        setting.wait(10)
    assert setting.unknown(1) and not setting.ready()
    with pytest.raises(IdentityPending):
        setting.token("org/llama")
