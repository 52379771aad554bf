"""``kvbucket verify URL [--delete-bad]`` through the installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.envelope import HEADER_SIZE
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import chunk_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=8)
SCRIPT = str(Path(sys.executable).with_name("kvbucket"))


def kvbucket(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)


def table_rows(stdout: str) -> dict[str, str]:
    """status -> object count, from the table ``kvbucket verify`` prints."""
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in stdout.splitlines()
             if line.startswith("│")]
    return {c[0]: c[1] for c in cells}


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("org/model", 1, 0, i, "bfloat16")


def test_verify_reports_and_deletes_bad_objects(tmp_path: Path) -> None:
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(5)])
    raw = FileStore(tmp_path)
    damaged = bytearray(raw.get(key_to_name(key(1))) or b"")
    damaged[HEADER_SIZE + 7] ^= 1
    raw.put(key_to_name(key(1)), damaged)  # corrupt
    raw.put(key_to_name(key(2)), raw.get(key_to_name(key(3))) or b"")  # foreign: another name's chunk
    raw.put("legacy-object", b"raw bytes written before sealing")  # legacy
    full = LAYOUT.full_chunk_bytes + HEADER_SIZE

    proc = kvbucket("verify", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows == {"good": "3", "corrupt": "1", "foreign": "1", "legacy": "1",
                    "bookkeeping": "0"}, proc.stdout
    assert f"corrupt (checksum): {key_to_name(key(1))}" in proc.stdout
    assert f"foreign (name): {key_to_name(key(2))}" in proc.stdout
    assert raw.head(key_to_name(key(1))) == full  # nothing removed without --delete-bad

    proc = kvbucket("verify", f"file://{tmp_path}", "--delete-bad")
    assert proc.returncode == 1 and "removed 1 of 1 damaged objects" in proc.stdout
    assert raw.head(key_to_name(key(1))) is None
    assert raw.head(key_to_name(key(2))) == full  # intact, under another name: not damage, kept
    assert raw.exists("legacy-object")  # legacy objects are reported, never removed

    proc = kvbucket("verify", str(tmp_path))
    assert proc.returncode == 1 and table_rows(proc.stdout)["corrupt"] == "0", proc.stdout + proc.stderr
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as b:
        assert sorted(b.list()) == sorted(key(i).to_string() for i in (0, 2, 3, 4))


def test_verify_on_the_parent_of_a_tiers_directory_checks_it_and_removes_nothing(tmp_path: Path) -> None:
    """Issue 24 item 10: every good chunk was reported "foreign (name)" and deleted (7 of 7); issue 40
    item 3: they verify under the tier's directory, grouped by it, and the command passes."""
    tier = FileStore(tmp_path / "remote")
    with RemoteBackend(tier, LAYOUT) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(7)])
    proc = kvbucket("verify", str(tmp_path), "--delete-bad")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert table_rows(proc.stdout)["good"] == "7" and table_rows(proc.stdout)["foreign"] == "0", proc.stdout
    assert "  remote/: 7 good" in proc.stdout and "hint:" not in proc.stdout
    assert "removed 0 of 0 damaged objects" in proc.stdout
    assert len(list(tier.list())) == 7
    proc = kvbucket("verify", f"file://{tmp_path}/remote")
    assert proc.returncode == 0 and table_rows(proc.stdout)["good"] == "7", proc.stdout


def test_verify_keeps_misnamed_objects_when_most_are(tmp_path: Path) -> None:
    """Most objects under other names (no root below fits): the URL, not the objects, is wrong."""
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(3)])
    raw = FileStore(tmp_path)
    for i in range(2):
        raw.put(f"renamed-{i}", raw.get(key_to_name(key(i))) or b"")
        raw.delete(key_to_name(key(i)))
    proc = kvbucket("verify", str(tmp_path), "--delete-bad")
    assert proc.returncode == 1 and "hint: the URL looks wrong: 2 of 3 objects" in proc.stdout, proc.stdout
    assert raw.exists("renamed-0") and raw.exists("renamed-1")


def test_verify_delete_bad_keeps_chunks_of_a_key_it_lacks(tmp_path: Path) -> None:
    """--delete-bad removes damage only: a chunk under another tenant's key is reported foreign
    (decrypt) and kept for the tenant whose key opens it (docs/integrity.md, the delete rule)."""
    import base64
    import json

    from kvbucket.encryption import Keyring

    keys = {who: os.urandom(32) for who in ("a", "b")}
    with RemoteBackend(FileStore(tmp_path / "kv"), LAYOUT, encryption=Keyring({"*": {1: keys["a"]}})) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(2)])
    raw = FileStore(tmp_path / "kv")
    damaged = bytearray(raw.get(key_to_name(key(1))) or b"")
    damaged[HEADER_SIZE + 3] ^= 1
    raw.put(key_to_name(key(1)), damaged)
    ring_b = tmp_path / "b.json"
    ring_b.write_text(json.dumps({"tenants": {"*": {"1": base64.b64encode(keys["b"]).decode()}}}))
    proc = kvbucket("verify", str(tmp_path / "kv"), "--keyring-file", str(ring_b), "--delete-bad")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"foreign (decrypt): {key_to_name(key(0))}" in proc.stdout
    assert f"corrupt (checksum): {key_to_name(key(1))}" in proc.stdout
    assert "removed 1 of 1 damaged objects" in proc.stdout
    assert raw.exists(key_to_name(key(0))) and not raw.exists(key_to_name(key(1)))


def test_verify_bad_input_is_exit_2(tmp_path: Path) -> None:
    proc = kvbucket("verify", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "error:" in proc.stderr
    proc = kvbucket("verify", str(tmp_path), "--keyring-file", str(tmp_path / "nokeys.json"))
    assert proc.returncode == 2 and "keyring" in proc.stderr


def test_verify_help_renders() -> None:
    proc = kvbucket("verify", "--help")
    assert proc.returncode == 0 and "--delete-bad" in proc.stdout


def test_kvbucket_stats_shows_integrity_counts(tmp_path: Path) -> None:
    """A refused chunk is counted per tier and reason, and ``kvbucket stats`` prints it."""
    from prometheus_client import REGISTRY

    from kvbucket.metrics import start_metrics_server, summarize

    with RemoteBackend(FileStore(tmp_path), LAYOUT) as b:
        b.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(2)])
        raw = FileStore(tmp_path)
        data = bytearray(raw.get(key_to_name(key(1))) or b"")
        data[-1] ^= 0xFF
        raw.put(key_to_name(key(1)), data)
        assert b.get(key(0)) is not None and b.get(key(1)) is None
    from prometheus_client import generate_latest

    summary = summarize(generate_latest(REGISTRY).decode())
    assert summary.integrity_failures[("remote", "checksum")] >= 1
    assert summary.integrity_verified["remote"] >= 1
    with start_metrics_server(0) as server:
        proc = kvbucket("stats", "--url", server.url)  # another process: reads this one's endpoint
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("integrity:"))
    assert "objects verified on load" in line and "remote checksum" in line
    assert "removed as damaged" in line and summary.integrity_removed["remote"] >= 1


def test_verify_checks_a_compile_cache_by_its_sha256s(tmp_path: Path) -> None:
    from kvbucket.compile_cache import NeuronLayout, sync
    from kvbucket.testing.neuron_standin import DEFAULT_VERSION, StandInCompiler

    host = StandInCompiler(tmp_path / "local", DEFAULT_VERSION)
    for g in ("g0", "g1"):
        host.compile(g)
    bucket = tmp_path / "bucket"
    raw = FileStore(bucket)
    sync(raw, NeuronLayout(DEFAULT_VERSION), host.cache_dir)
    proc = kvbucket("verify", str(bucket))
    # 2 entries x 4 files and the pack verify by sha256; the pack index and 2 records are metadata
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert rows == {"good": "9", "corrupt": "0", "foreign": "0", "legacy": "3",
                    "bookkeeping": "0"}, proc.stdout

    neff = f"{host.module_dir('g1').relative_to(host.cache_dir).as_posix()}/model.neff"
    pack = next(o.name for o in raw.list(".kvbucket/packs/") if o.name.endswith(".pack"))
    for name in (neff, pack):
        data = bytearray(raw.get(name) or b"")
        data[100] ^= 1
        raw.put(name, bytes(data))
    proc = kvbucket("verify", str(bucket), "--delete-bad")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"corrupt (checksum): {neff}" in proc.stdout and f"corrupt (checksum): {pack}" in proc.stdout
    assert "removed 2 of 2" in proc.stdout and not raw.exists(neff) and not raw.exists(pack)


def test_verify_delete_bad_keeps_files_kvbucket_never_wrote(tmp_path: Path) -> None:
    """Only kvbucket's own chunks can be damaged chunks (issue 39): prefixes of the magic, a
    ``KVBE...`` text file and a newer format are reported (legacy/foreign), never removed."""
    raw = FileStore(tmp_path)
    files = {"k": b"K", "kvb": b"KVB", "notes/kvbe.md": b"KVBE notes: " + b"x" * 88,
             "future": b"KVBE\x02" + bytes(120)}
    raw.put_many(list(files.items()))
    proc = kvbucket("verify", str(tmp_path), "--delete-bad")
    assert table_rows(proc.stdout)["corrupt"] == "0", proc.stdout + proc.stderr
    assert "removed 0 of 0 damaged objects" in proc.stdout
    assert {n: raw.get(n) for n in files} == files


def test_verify_delete_bad_keeps_an_object_damaged_only_on_the_wire(
    seaweedfs: Any, s3_bucket: str, fault_proxy: Any,
) -> None:
    """A bit flipped in transit makes the first read corrupt; the second read (a new connection)
    is intact, so ``--delete-bad`` keeps the object and says so."""
    from kvbucket.stores.s3.config import S3Config
    from kvbucket.stores.s3.store import S3Store
    from kvbucket.testing.fault_proxy import FLIP

    with RemoteBackend(S3Store(S3Config.parse(seaweedfs.config(s3_bucket))), LAYOUT) as b:
        b.batched_put([(key(1), chunk_bytes(LAYOUT, 1))])
    fault_proxy.fail(FLIP, times=1, methods={"GET"}, path_contains="bfloat16")  # the object, not a listing
    env = {**os.environ, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url, "COLUMNS": "200",
           "NO_COLOR": "1"}
    proc = subprocess.run([SCRIPT, "verify", f"s3://{s3_bucket}", "--delete-bad"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert fault_proxy.injected == 1, (proc.stdout + proc.stderr, fault_proxy.targets)
    assert "removed 0 of 1 damaged objects" in proc.stdout, (proc.stdout, fault_proxy.targets)
    assert "kept 1" in proc.stdout
    with S3Store(S3Config.parse(seaweedfs.config(s3_bucket))) as s:
        assert s.head(key_to_name(key(1))) == LAYOUT.full_chunk_bytes + HEADER_SIZE
