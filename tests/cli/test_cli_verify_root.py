"""Issue 40 item 3: ``kvbucket verify`` at a bucket's root (tiers under prefixes, a fleet's
journals, identity manifests) passes on healthy data, groups by prefix, and names kvbucket's own
bookkeeping objects as such; run as the installed console script."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

from kvbucket.fleet.config import FleetConfig
from kvbucket.identity.core import IdentitySetting
from kvbucket.keys import ObjectKey
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.l2.naming import Naming
from kvbucket.stores import open_store
from kvbucket.stores.local.file import FileStore
from kvbucket.testing import l2 as t

FAST = {"sync_secs": 0.1, "heartbeat_secs": 0.3, "node_timeout_secs": 30.0, "compact_secs": 0.3}
CHUNK = 512


def keys(n: int, first: int = 0) -> list[ObjectKey]:
    return [ObjectKey("org/llama", 0, (first + i).to_bytes(8, "big")) for i in range(n)]


def fill(url: str, n: int, fleet: bool) -> None:
    """``n`` chunks through a real L2 adapter with an identity (its manifest) and, with ``fleet``,
    a fleet node (journals, heartbeat, snapshot, digest)."""
    store = open_store(url)
    naming = Naming(identity=IdentitySetting("org/llama@1"))
    adapter = ObjectStoreL2Adapter(store, full_chunk_bytes=CHUNK, naming=naming,
                                   fleet=FleetConfig(node_id="node-a", **FAST) if fleet else None)
    try:
        assert t.store(adapter, keys(n), [bytes([i + 1]) * CHUNK for i in range(n)]).success
        deadline = time.monotonic() + 30
        while not any("/_identity/" in f"/{i.name}" for i in store.list("")) or (
                fleet and sum("_fleet/" in i.name for i in store.list("")) < 3):
            assert time.monotonic() < deadline, sorted(i.name for i in store.list(""))
            time.sleep(0.1)
    finally:
        adapter.close()


def test_verify_at_the_root_passes_on_healthy_tiers(tmp_path: Path, cli_env: dict[str, str]) -> None:
    fill(str(tmp_path / "kv"), 5, fleet=True)
    fill(str(tmp_path / "llama"), 3, fleet=False)
    FileStore(tmp_path).put("notes.txt", b"not kvbucket's")
    r = run_cli("verify", str(tmp_path), "--json", env=cli_env)
    assert r.code == 0, r.out + r.err
    doc = json.loads(r.out)
    totals = {s: v["objects"] for s, v in doc["totals"].items()}
    book = totals.pop("bookkeeping")
    assert totals == {"good": 8, "corrupt": 0, "foreign": 0, "legacy": 1}, doc
    assert book >= 4  # two manifests, and the fleet's journal, heartbeat, ...
    assert doc["by_prefix"]["kv"]["good"] == 5 and doc["by_prefix"]["llama"]["good"] == 3, doc
    assert doc["by_prefix"]["llama"]["bookkeeping"] == 1 and doc["by_prefix"][""] == {"legacy": 1}
    assert [b["name"] for b in doc["not_good"]] == ["notes.txt"] and doc["wrong_url"] is None
    table = run_cli("verify", str(tmp_path), env=cli_env)
    assert table.code == 0 and "  kv/: 5 good, " in table.out, table.out
    assert "  llama/: 3 good, 1 bookkeeping" in table.out, table.out
    assert "foreign (name)" not in table.out and "legacy (unsealed): kv/_identity" not in table.out
    # damage under a prefix is still damage, found under the prefix's own name
    raw = FileStore(tmp_path)
    name = next(i.name for i in raw.list("kv/") if "_" not in i.name.split("/")[1][:1])
    damaged = bytearray(raw.get(name) or b"")
    damaged[-1] ^= 1
    raw.put(name, bytes(damaged))
    bad = run_cli("verify", str(tmp_path), "--json", env=cli_env)
    assert bad.code == 1 and json.loads(bad.out)["totals"]["corrupt"]["objects"] == 1, bad.out


def test_the_documented_verify_of_a_bucket_passes(hub_bucket: Any, cli_env: dict[str, str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cli.md's `kvbucket verify my-org/kv-cache --json`, its tier writing under a prefix."""
    hub = hub_bucket.hub
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.write_token)
    fill(f"hf://buckets/{hub_bucket.bucket_id}/kv-cache", 4, fleet=False)
    env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token,
           "HF_HOME": str(tmp_path / "hf")}
    r = run_cli("verify", hub_bucket.bucket_id, "--json", env=env, cwd=tmp_path)
    assert r.code == 0, r.out + r.err
    doc = json.loads(r.out)
    assert doc["totals"]["good"]["objects"] == 4 and doc["totals"]["bookkeeping"]["objects"] == 1, doc


def _corrupt_one(root: Path, prefix: str) -> str:
    """Flip the last payload byte of one chunk under ``prefix``; its name."""
    raw = FileStore(root)
    name = next(i.name for i in raw.list(f"{prefix}/") if not i.name.split("/")[1].startswith("_"))
    damaged = bytearray(raw.get(name) or b"")
    damaged[-1] ^= 1
    raw.put(name, bytes(damaged))
    return name


def test_delete_bad_at_the_root_removes_the_corrupt_chunk_under_its_prefix(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    fill(str(tmp_path / "kv"), 4, fleet=True)
    before = {i.name for i in FileStore(tmp_path).list("")}
    name = _corrupt_one(tmp_path, "kv")
    r = run_cli("verify", str(tmp_path), "--delete-bad", env=cli_env)
    assert r.code == 1, r.out + r.err
    assert "removed 1 of 1 damaged objects" in r.out and "kept " not in r.out, r.out
    assert f"corrupt (checksum): {name}" in r.out, r.out
    assert "below the URL" not in r.out, r.out  # corrupt is corrupt, not "check it elsewhere"
    after = {i.name for i in FileStore(tmp_path).list("")}
    assert after == before - {name}, before ^ after  # healthy chunks, _identity/ and _fleet/ kept
    assert any("_identity/" in n for n in after) and any("_fleet/" in n for n in after)
    again = run_cli("verify", str(tmp_path), "--json", env=cli_env)
    assert again.code == 0 and json.loads(again.out)["totals"]["good"]["objects"] == 3, again.out
