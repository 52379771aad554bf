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
    pytest.importorskip("lmcache", reason="the lmcache extra is not installed")
    from tests_l2_helpers import mp_adapter, mp_read, mp_store_result  # type: ignore[import-not-found]

    d = make_model_dirs(tmp_path / "models")["base"]
    root = tmp_path / "kv"
    adapter = mp_adapter(root, model_identity=str(d))
    try:
        assert mp_read(adapter) == ([], [])
        assert not mp_store_result(adapter) and chunk_files(root) == []
        status = adapter.impl.report_status()["identity_pending"]
        assert status["misses"] >= 5 and status["refused"] == 5
        held.set()
        assert adapter.impl.naming.identity.wait(30)
        assert mp_store_result(adapter)
        assert mp_read(adapter) == (list(range(5)), list(range(5)))
    finally:
        adapter.close()
    token = identity_of_dir(d, "org/llama").token
    assert all(f"~{token}@" in n for n in chunk_files(root))


def test_lmcache_connector_misses_and_drops_until_known(tmp_path: Path, held: threading.Event,
                                                        lm_loop: object) -> None:
    pytest.importorskip("lmcache", reason="the lmcache extra is not installed")
    from tests_l2_helpers import conn_put, conn_read, connector, run  # type: ignore[import-not-found]

    d = make_model_dirs(tmp_path / "models")["base"]
    root = tmp_path / "kv"
    conn = connector(lm_loop, root, model_identity=str(d))
    try:
        assert conn_read(conn, lm_loop) == (0, [])
        conn_put(conn, lm_loop)  # dropped, counted: nothing written under any name
        assert chunk_files(root) == [] and run(lm_loop, conn.list()) == []
        assert conn.naming.identity.pending_counts()["refused"] == 5
        held.set()
        assert conn.naming.identity.wait(30)
        conn_put(conn, lm_loop)
        assert conn_read(conn, lm_loop) == (5, list(range(5)))
    finally:
        run(lm_loop, conn.close())
    token = identity_of_dir(d, "org/llama").token
    assert len(chunk_files(root)) == 5 and all(f"~{token}@" in n for n in chunk_files(root))
