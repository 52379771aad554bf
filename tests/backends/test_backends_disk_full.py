"""The disk tier on a full filesystem: evict to make room, else skip; never fail a stored put,
never lose a good old copy.

Each test runs on a real 20 MiB tmpfs (mounted for the test; needs root, as here and in CI) and
on an injected ENOSPC (os.write and os.writev fail once the files under the directory would pass 20 MiB), so
it also runs where mounting is not allowed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.errors import NoSpaceError
from kvbucket.metrics import InstrumentedBackend, start_metrics_server
from kvbucket.stores.local.memory import MemoryStore

MIB = 1 << 20
FS_BYTES = 20 * MIB
GB = 1 << 30
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", chunk_tokens=1024)
CHUNK = LAYOUT.full_chunk_bytes  # 1 MiB


def chunk(i: int) -> np.ndarray:
    return np.full(CHUNK, i % 251, dtype=np.uint8)


class SmallFS:
    """A directory on a filesystem of ``FS_BYTES``: a real tmpfs, or an injected quota."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self.mode = mode

    def fill(self) -> None:
        """Take every free byte with a file kvbucket does not own."""
        filler = self.path / f"filler-{uuid.uuid4().hex}"
        if self.mode == "tmpfs":
            # Unbuffered: a partly written block must not be flushed again (and fail) on close,
            # which happens when the free space is not a multiple of the block (sealed chunk
            # files are 64 bytes longer than a chunk, so it is not).
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
        else:
            with open(filler, "wb") as f:
                f.truncate(max(0, FS_BYTES - _usage(self.path)))

    def free(self) -> None:
        for p in self.path.glob("filler-*"):
            p.unlink()


def _usage(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(d, f)).st_size
    return total


@pytest.fixture(params=["tmpfs", "injected"])
def small_fs(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SmallFS]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if request.param == "tmpfs":
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected variant covers this")
        try:
            yield SmallFS(mnt, "tmpfs")
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
        return
    real_write, real_writev = os.write, os.writev
    root = str(mnt)

    def room_for(fd: int) -> int | None:
        """Bytes the quota still allows on ``fd`` (None: not under the directory); ENOSPC at 0."""
        try:
            ours = os.readlink(f"/proc/self/fd/{fd}").startswith(root + "/")
        except OSError:
            ours = False
        if not ours:
            return None
        room = FS_BYTES - _usage(mnt)
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return room

    def quota_write(fd: int, data: bytes | memoryview) -> int:
        room = room_for(fd)
        return real_write(fd, data if room is None else memoryview(data)[:room])

    def quota_writev(fd: int, buffers: Sequence[Any]) -> int:
        """The directory store writes sealed objects (header + payload) with one writev."""
        room = room_for(fd)
        if room is None:
            return real_writev(fd, buffers)
        cut: list[memoryview] = []
        for b in buffers:
            v = memoryview(b).cast("B")[:room]
            cut.append(v)
            room -= v.nbytes
            if room <= 0:
                break
        return real_writev(fd, cut)

    monkeypatch.setattr(os, "write", quota_write)
    monkeypatch.setattr(os, "writev", quota_writev)
    yield SmallFS(mnt, "injected")


def test_a_disk_tier_larger_than_its_filesystem_evicts_to_make_room(small_fs: SmallFS) -> None:
    disk = LocalDiskBackend(small_fs.path / "disk", GB)
    try:
        for i in range(45):  # 45 MiB through a 20 MiB filesystem
            disk.put(f"k{i}", chunk(i))  # never raises
        assert disk.get("k44") is not None and bytes(disk.get("k44")) == chunk(44).tobytes()
        assert disk.evictions >= 20 and disk.skipped_full == 0
        assert disk.used_bytes <= FS_BYTES
        assert disk.get("k0") is None, "the least recently used chunks made room"
        assert all(bytes(disk.get(k)) == chunk(int(k[1:])).tobytes() for k in disk.list())
    finally:
        disk.close()


def test_a_full_disk_is_skipped_and_the_hybrid_put_still_succeeds(
    small_fs: SmallFS, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = LocalCPUBackend(64 * MIB)
    disk = LocalDiskBackend(small_fs.path / "disk", GB)
    remote = RemoteBackend(MemoryStore(), LAYOUT)
    tier = f"local_disk_full_{small_fs.mode}"
    hybrid = HybridBackend([cpu, InstrumentedBackend(disk, tier), remote])
    try:
        small_fs.fill()  # nothing of the tier's own to evict: it cannot write at all
        caplog.set_level(logging.WARNING, logger="kvbucket")
        for i in range(5):
            hybrid.put(f"k{i}", chunk(i))  # no TierPutError: CPU and remote stored it
        assert hybrid.batched_put_results([("k9", chunk(9))]) == [None]
        assert disk.skipped_full == 6 and hybrid.tier_skips == [0, 6, 0]
        assert REGISTRY.get_sample_value(
            "kvbucket_backend_operations_total", {"tier": tier, "op": "put", "result": "skipped"}
        ) == 6
        full_logs = [r for r in caplog.records if "filesystem is full" in r.getMessage()]
        assert len(full_logs) == 1, "logged once per full episode, not per chunk"
        assert disk.list() == [] and disk.used_bytes == 0, "nothing skipped is counted as stored"
        assert remote.contains("k3") and bytes(hybrid.get("k3")) == chunk(3).tobytes()
        disk.put("q", chunk(11), blocking=False)  # a queued put is skipped quietly, and counted
        disk.flush()
        assert disk.skipped_full == 7 and not disk.contains("q")
        url = disk.store.url
        assert REGISTRY.get_sample_value("kvbucket_disk_skipped_full_total", {"dir": url}) == 7
        if small_fs.mode == "injected":  # `kvbucket stats` shows it (the same code for both modes)
            with start_metrics_server(0) as server:
                out = subprocess.run(
                    [sys.executable, "-m", "kvbucket", "stats", "--url", server.url],
                    capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
                )
            assert out.returncode == 0, out.stderr
            assert f"disk tier {url}: 7 chunks skipped, filesystem full" in out.stdout, out.stdout

        small_fs.free()  # space is back: the tier stores again
        hybrid.put("k10", chunk(10))
        assert disk.contains("k10") and disk.skipped_full == 7
    finally:
        hybrid.close()


def test_a_re_put_on_a_full_disk_keeps_the_old_copy(small_fs: SmallFS) -> None:
    disk = LocalDiskBackend(small_fs.path / "disk", GB)
    try:
        disk.put("k", chunk(1))
        small_fs.fill()
        with pytest.raises(NoSpaceError):
            disk.put("k", chunk(2))  # alone (no other tier), a skip is an error for the caller
        got = disk.get("k")
        assert got is not None and bytes(got) == chunk(1).tobytes(), "the good old copy was deleted"
        assert disk.list() == ["k"] and disk.used_bytes == CHUNK
        disk.put("k", chunk(3), blocking=False)  # a queued put that cannot land: skipped quietly
        disk.flush()
        assert bytes(disk.get("k")) == chunk(1).tobytes() and disk.skipped_full == 2
    finally:
        disk.close()
    reopened = LocalDiskBackend(small_fs.path / "disk", GB)
    try:
        assert bytes(reopened.get("k")) == chunk(1).tobytes()
    finally:
        reopened.close()
