"""LocalDiskBackend specifics: restart recovery, a crash mid-write, bounds after restart, modes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.chunks import KVLayout
from kvbucket.errors import ConfigError
from kvbucket.keys import key_to_name
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes, key

LAYOUT = KVLayout(4, 4, 64, "bfloat16", chunk_tokens=64)  # 256 KiB chunks
FULL = LAYOUT.full_chunk_bytes

CHILD = textwrap.dedent("""
    import sys
    from kvbucket.backends.local_disk import LocalDiskBackend
    from kvbucket.chunks import KVLayout
    from kvbucket.testing.backend_tests import chunk_bytes, key
    layout = KVLayout(4, 4, 64, "bfloat16", chunk_tokens=64)
    b = LocalDiskBackend(sys.argv[1], 1 << 30)
    i = 0
    while True:
        b.put(key(i), chunk_bytes(layout, i))
        print(i, flush=True)  # acknowledged
        i += 1
""")


def test_crash_mid_write_loses_nothing_acknowledged(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True,
                            env=env)
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        while len(acked) < 12:
            line = proc.stdout.readline()
            assert line, "the writer died before acknowledging 12 chunks"
            acked.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-write of the next chunk, most likely
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    with LocalDiskBackend(root, 1 << 30) as b:
        listed = set(b.list())
        for i in acked:
            assert key(i).to_string() in listed
            assert as_bytes(b.get(key(i))) == chunk_bytes(LAYOUT, i)
        for k in listed:  # whatever else is there is complete (the write after the last ack)
            got = b.get(k)
            assert got is not None and len(as_bytes(got)) == FULL
        assert b.used_bytes == len(listed) * FULL


def test_restart_keeps_lru_order_and_enforces_a_lower_bound(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    with LocalDiskBackend(root, 10 * FULL) as b:
        for i in range(6):
            b.put(key(i), chunk_bytes(LAYOUT, i))
            os.utime(root / key_to_name(key(i)), (1_000_000 + i, 1_000_000 + i))  # distinct mtimes
    with LocalDiskBackend(root, 4 * FULL) as b:  # the bound was lowered: the oldest two go
        assert b.used_bytes == 4 * FULL
        assert sorted(b.list()) == sorted(key(i).to_string() for i in range(2, 6))
        assert not (root / key_to_name(key(0))).exists()
        b.put(key(6), chunk_bytes(LAYOUT, 6))  # evicts the oldest remaining one, key 2
        assert b.get(key(2)) is None and b.get(key(3)) is not None
        assert b.peak_bytes <= 4 * FULL


def test_files_are_private(tmp_path: Path) -> None:
    with LocalDiskBackend(tmp_path / "disk", 10 * FULL) as b:
        b.put(key(1), chunk_bytes(LAYOUT, 1))
    path = tmp_path / "disk" / key_to_name(key(1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "disk").stat().st_mode) == 0o700


def test_eviction_deletes_files_and_reports(tmp_path: Path) -> None:
    evicted: list[str] = []
    root = tmp_path / "disk"
    with LocalDiskBackend(root, 3 * FULL, on_evict=evicted.append) as b:
        for i in range(5):
            b.put(key(i), chunk_bytes(LAYOUT, i))
        assert evicted == [key(0).to_string(), key(1).to_string()]
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(
            key_to_name(key(i)) for i in range(2, 5))


def test_foreign_files_are_not_chunks(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    (root / "notes.txt").write_text("hello")
    with LocalDiskBackend(root, 10 * FULL) as b:
        assert b.list() == [] and b.used_bytes == 0
    assert (root / "notes.txt").exists()


def test_non_blocking_puts_survive_close_and_restart(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    b = LocalDiskBackend(root, 100 * FULL)
    for i in range(20):
        b.put(key(i), chunk_bytes(LAYOUT, i), blocking=False)
    b.close()
    with LocalDiskBackend(root, 100 * FULL) as again:
        assert [as_bytes(c) for c in again.batched_get([key(i) for i in range(20)])] == [
            chunk_bytes(LAYOUT, i) for i in range(20)]


def test_a_file_deleted_behind_its_back_is_forgotten(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    with LocalDiskBackend(root, 10 * FULL) as b:
        b.put(key(1), chunk_bytes(LAYOUT, 1))
        b.put(key(2), chunk_bytes(LAYOUT, 2))
        (root / key_to_name(key(1))).unlink()
        (root / key_to_name(key(2))).unlink()
        assert b.get(key(1)) is None
        assert b.batched_get_into([key(2)], [bytearray(FULL)]) == [False]
        assert not b.contains(key(1)) and not b.contains(key(2))
        assert b.used_bytes == 0 and b.list() == []


def test_one_disk_tier_per_directory(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    first = LocalDiskBackend(root, 10 * FULL)
    try:
        with pytest.raises(ConfigError, match=r"is in use by another LocalDiskBackend.*its own local_disk"):
            LocalDiskBackend(root, 10 * FULL)
        first.put(key(1), chunk_bytes(LAYOUT, 1))
        assert first.list() == [key(1).to_string()]  # the lock file is not a chunk
    finally:
        first.close()
    with LocalDiskBackend(root, 10 * FULL) as again:  # released by close()
        assert again.list() == [key(1).to_string()]
    assert stat.S_IMODE((root / ".kvbucket-disk.lock").stat().st_mode) == 0o600
