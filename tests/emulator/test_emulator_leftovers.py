"""What a killed server or a vanished client leaves (issue 29 item 12).

- A server killed mid-upload (SIGKILL: no cleanup) leaves ``xorbs/.tmp-*`` files, each
  preallocated to its xorb's full size; they were never removed. The next start removes those
  old enough to have no writer, and looks again at younger ones once they are.
- A client that disconnects during a fetch was logged as an internal error with a traceback;
  it is a disconnect, logged at DEBUG.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from huggingface_hub import HfApi

from kvbucket.testing import HubEmulator
from kvbucket.testing.fleet_node import until
from kvbucket.testing.hub_emulator import core

MiB = 1024 * 1024


def _plant(path: Path, size: int, age_s: float) -> Path:
    """A temp file as a killed upload leaves it: preallocated to ``size``, last written ``age_s`` ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.write(fd, b"partial xorb body")
    finally:
        os.close(fd)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_start_removes_the_temp_files_a_killed_upload_left(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    xorbs = data / "xorbs"
    old = [_plant(xorbs / ".tmp-killed1", 8 * MiB, 3600), _plant(xorbs / "ab" / ".tmp-killed2", 4 * MiB, 600)]
    young = _plant(xorbs / ".tmp-young", MiB, 0)  # maybe another live server's: not touched yet
    kept = _plant(xorbs / "ab" / "not-a-temp-file", MiB, 3600)
    with HubEmulator(data) as emu:
        assert not any(p.exists() for p in old)
        assert young.exists() and kept.exists()
        api = HfApi(endpoint=emu.endpoint, token=False)  # the server works as before
        api.create_bucket("local/after")
        api.batch_bucket_files("local/after", add=[(b"x" * 1000, "a")])
        assert [i.size for i in api.get_bucket_paths_info("local/after", ["a"])] == [1000]


def test_a_younger_temp_file_is_removed_once_it_is_old_enough(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STALE_TEMP_S", 1.0)
    data = tmp_path / "hub"
    young = _plant(data / "xorbs" / "cd" / ".tmp-just-killed", 2 * MiB, 0)
    with HubEmulator(data, body_timeout_s=0.25) as emu:
        assert emu.endpoint and young.exists()  # written less than a second ago: left at start
        assert until(lambda: not young.exists(), 30)  # looked at again once old enough


def _fetch_url(emu: HubEmulator, bucket: str, name: str) -> tuple[str, int]:
    api = HfApi(endpoint=emu.endpoint, token=False)
    (info,) = list(api.get_bucket_paths_info(bucket, [name]))
    with urllib.request.urlopen(f"{emu.endpoint}/api/buckets/{bucket}/xet-read-token") as r:
        tok = json.loads(r.read())
    req = urllib.request.Request(f"{tok['casUrl']}/v2/reconstructions/{info.xet_hash}",
                                 headers={"Authorization": f"Bearer {tok['accessToken']}"})
    with urllib.request.urlopen(req) as r:
        plan = json.loads(r.read())
    ((_, entries),) = plan["xorbs"].items()
    rng = entries[0]["ranges"][0]["bytes"]
    return entries[0]["url"], rng["end"] - rng["start"] + 1


def test_a_client_that_leaves_mid_fetch_is_a_quiet_disconnect(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvbucket.emulator")
    with HubEmulator(tmp_path / "hub") as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/big")
        api.batch_bucket_files("local/big", add=[(os.urandom(48 * MiB), "big")])  # incompressible
        url, size = _fetch_url(emu, "local/big", "big")
        assert size > 32 * MiB  # far more than the loopback socket buffers take at once
        before = emu.stats()["routes"].get("fetch", {}).get("requests", 0)
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(f"GET {parts.path}?{parts.query} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Range: bytes=0-{size - 1}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 206")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, with most of the body still to send
        assert until(lambda: any("disconnected" in r.getMessage() for r in caplog.records), 30)
        assert emu.stats()["routes"]["fetch"]["requests"] == before + 1
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    (gone,) = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert gone.levelno == logging.DEBUG and gone.exc_info is None and "fetch" in gone.getMessage()
