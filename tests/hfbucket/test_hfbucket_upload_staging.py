"""Uploads staged as private files in RAM (stores/hub/xet/uploads.py), on the emulator with the real hf_xet.

Objects from ``STAGE_MIN_BYTES`` go to hf_xet by ``start_upload_file`` (read in Rust, without the
GIL) from a 0600 file in a 0700 directory on /dev/shm, written with ``os.writev``; smaller ones,
and every object when there is no tmpfs or no room on it, by ``start_upload_bytes`` as before.
The tests record what hf_xet is handed (through a wrapper around the commit), check the files
while hf_xet has them and that none is left after success, failure, timeout and process exit,
that the requests are the same either way, and that what was stored reads back.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbucket.errors import StoreError
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import uploads as xet_uploads
from kvbucket.testing.hub_emulator.request_log import count_routes
from kvbucket.testing.payloads import payload

MIN = xet_uploads.STAGE_MIN_BYTES
needs_shm = pytest.mark.skipif(not xet_uploads._on_tmpfs("/dev/shm"), reason="no tmpfs at /dev/shm")


class _Commit:
    """An hf_xet commit that records what each upload is handed (and checks staged files then)."""

    def __init__(self, real: Any, log: list[tuple[str, Any]], hold: threading.Event | None) -> None:
        self.real, self.log, self.hold = real, log, hold

    def __enter__(self) -> _Commit:
        self.real.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self.hold is not None:  # hf_xet never returning: only the timeout handler can clean up
            self.hold.wait(60)
        return self.real.__exit__(*exc)

    def start_upload_file(self, path: str, **k: Any) -> Any:
        st, parent = os.stat(path, follow_symlinks=False), os.stat(os.path.dirname(path))
        with open(path, "rb") as f:
            content = f.read()
        self.log.append(("file", {
            "path": path, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "bytes": content,
            "regular": stat.S_ISREG(st.st_mode), "uid": st.st_uid, "dir_mode": stat.S_IMODE(parent.st_mode),
            "sha256": k.get("sha256"),
        }))  # fmt: skip
        return self.real.start_upload_file(path, **k)

    def start_upload_bytes(self, data: Any, **k: Any) -> Any:
        self.log.append(("bytes", len(data)))
        return self.real.start_upload_bytes(data, **k)

    def abort(self) -> None:
        self.real.abort()


def _recorded(store: HFBucketStore, monkeypatch: pytest.MonkeyPatch,
              hold: threading.Event | None = None) -> list[tuple[str, Any]]:
    log: list[tuple[str, Any]] = []
    commits = store._client._commits
    take = commits.take
    monkeypatch.setattr(commits, "take", lambda *a, **k: _Commit(take(*a, **k), log, hold))
    return log


@pytest.fixture
def store(hub_bucket: Any) -> Iterator[HFBucketStore]:
    hub = hub_bucket.hub
    with HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/s-{uuid.uuid4().hex[:6]}", token=hub.write_token,
        endpoint=hub.endpoint, token_env="", retry_backoff_secs=0.01, breaker_failures=0,
    )) as s:
        assert s.put_many([("warm", b"w" * 100)])[0].ok  # token and commit ready
        yield s


def _left_in_staging() -> list[str]:
    d = xet_uploads.staging_dir()
    return [] if d is None else os.listdir(d)


def _read_back(store: Any, items: list[tuple[str, Any]]) -> None:
    outs = [np.empty(np.asarray(d).nbytes, np.uint8) for _, d in items]
    assert all(r.found for r in store.get_many([n for n, _ in items], outs))
    for o, (_, d) in zip(outs, items, strict=True):
        assert o.tobytes() == np.asarray(d).tobytes()


@needs_shm
def test_objects_from_the_threshold_go_by_private_file_in_ram_and_the_files_are_gone_after(
    store: HFBucketStore, hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [MIN - 1, MIN, 3 * MIN + 5, 100]
    items = [(f"o{i}", payload("kv", n, f"stage-{i}-{uuid.uuid4()}")) for i, n in enumerate(sizes)]
    log = _recorded(store, monkeypatch)
    assert [r.size for r in store.put_many(items)] == sizes
    assert [kind for kind, _ in log] == ["bytes", "file", "file", "bytes"]
    from hf_xet import SKIP_SHA256

    for (_, f), (_, d) in zip([e for e in log if e[0] == "file"], items[1:3], strict=True):
        assert f["path"].startswith("/dev/shm/kvbucket-upload-") and f["regular"]
        assert (f["mode"], f["dir_mode"], f["uid"]) == (0o600, 0o700, os.getuid())
        assert f["size"] == d.nbytes and f["bytes"] == d.tobytes()
        assert f["sha256"] is SKIP_SHA256  # not hashed by hf_xet (the Hub never asks for it)
        assert not os.path.exists(f["path"])
    assert _left_in_staging() == []
    _read_back(store, items)


@needs_shm
def test_a_sealed_store_writes_header_and_caller_buffer_into_the_file_unjoined(
    store: HFBucketStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined: list[Any] = []
    monkeypatch.setattr(xet_uploads, "upload_bytes", lambda d, reuse=None: joined.append(d) or bytes(d))
    log = _recorded(store, monkeypatch)
    sealed = seal_store(store, tier="test")
    items = [(f"s{i}", payload("kv", 2 * MIN, f"sealed-{i}-{uuid.uuid4()}")) for i in range(3)]
    assert all(r.ok for r in sealed.put_many(items))
    assert [kind for kind, _ in log] == ["file"] * 3 and joined == []  # no Gather.join, no bytes
    assert all(f["size"] == 64 + 2 * MIN for _, f in log)
    _read_back(sealed, items)


@needs_shm
def test_the_requests_are_the_same_by_file_and_by_bytes(
    store: HFBucketStore, hub_bucket: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    hub = hub_bucket.hub
    routes = {}
    for how in ("file", "bytes"):
        if how == "bytes":  # a directory on disk: never staged there
            monkeypatch.setenv(xet_uploads.STAGING_ENV, str(tmp_path))
        log = _recorded(store, monkeypatch)
        items = [(f"{how}{i}", payload("random", 2 * MIN, f"{how}-{i}-{uuid.uuid4()}")) for i in range(4)]
        hub.emulator.requests(clear=True)
        assert all(r.ok for r in store.put_many(items))
        routes[how] = count_routes(hub.emulator.requests(clear=True))
        assert [kind for kind, _ in log] == [how] * 4
        _read_back(store, items)
    assert routes["file"] == routes["bytes"], routes
    assert routes["file"].get("batch") == 1 and routes["file"].get("shard_upload") == 1
    assert os.listdir(tmp_path) == []  # nothing was written on the disk directory


@needs_shm
def test_no_room_on_the_tmpfs_or_a_failed_write_takes_the_bytes_path(
    store: HFBucketStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [(f"r{i}", payload("kv", 2 * MIN, f"room-{i}-{uuid.uuid4()}")) for i in range(2)]
    log = _recorded(store, monkeypatch)
    monkeypatch.setattr(xet_uploads, "_room_for", lambda d, n: False)
    assert all(r.ok for r in store.put_many(items[:1]))
    monkeypatch.undo()
    log = _recorded(store, monkeypatch)

    def full(fd: int, data: Any) -> None:
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(xet_uploads, "_write_all", full)
    assert all(r.ok for r in store.put_many(items[1:]))
    assert [kind for kind, _ in log] == ["bytes"]
    assert _left_in_staging() == []  # the partial file was unlinked
    _read_back(store, items)


def test_by_bytes_one_commits_objects_of_one_size_share_one_joined_buffer_never_a_callers(
    store: HFBucketStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging off: hf_xet copies the buffer before its call returns, so the next object of the
    same size is joined into the same bytearray (no fresh pages zeroed holding the GIL); a
    caller's own bytearray is handed over as it is and never written."""
    monkeypatch.setenv(xet_uploads.STAGING_ENV, "off")
    calls: list[tuple[int, int | None, int]] = []  # (id of data, id of reuse, id of the result)
    real = xet_uploads.upload_bytes

    def spy(d: Any, reuse: bytearray | None = None) -> bytes | bytearray:
        out = real(d, reuse)
        calls.append((id(d), None if reuse is None else id(reuse), id(out)))
        return out

    monkeypatch.setattr(xet_uploads, "upload_bytes", spy)
    n = 2 * MIN
    callers = bytearray(payload("random", n, f"callers-{uuid.uuid4()}").tobytes())
    before = bytes(callers)
    items = [("a0", payload("kv", n, f"a0-{uuid.uuid4()}")), ("a1", payload("kv", n, f"a1-{uuid.uuid4()}")),
             ("mine", callers), ("view", memoryview(callers)), ("a2", payload("kv", n, f"a2-{uuid.uuid4()}")),
             ("odd", payload("kv", n + 2, f"odd-{uuid.uuid4()}"))]
    assert all(r.ok for r in store.put_many(items))
    assert bytes(callers) == before  # the caller's buffer was never a join's target
    first = calls[0][2]
    assert calls[1][1] == first and calls[1][2] == first  # a1 joined into a0's buffer
    assert calls[2][2] == id(callers) and calls[3][2] == id(callers)  # handed over as they are
    assert calls[4][1] == first and calls[4][2] == first  # still the join's own buffer, not callers
    assert calls[5][2] != first  # another size: a new buffer
    _read_back(store, [(k, np.frombuffer(bytes(v), np.uint8)) for k, v in items])


def test_the_staging_setting_is_auto_off_or_a_directory_on_a_tmpfs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    env = xet_uploads.STAGING_ENV
    monkeypatch.delenv(env, raising=False)
    on_shm = xet_uploads._on_tmpfs("/dev/shm")
    assert xet_uploads.staging_root() == ("/dev/shm" if on_shm else None)
    monkeypatch.setenv(env, "off")
    assert xet_uploads.staging_root() is None and xet_uploads.staging_dir() is None
    monkeypatch.setenv(env, str(tmp_path))  # a disk (the test's tmp directory is not a tmpfs here)
    if not xet_uploads._on_tmpfs(str(tmp_path)):
        with caplog.at_level("WARNING", logger="kvbucket.stores.hub.xet.uploads"):
            assert xet_uploads.staging_root() is None
            assert xet_uploads.staging_root() is None
        warned = [r.getMessage() for r in caplog.records if env in r.getMessage()]
        assert len(warned) == 1 and "not a directory on a tmpfs" in warned[0], warned  # once
    if on_shm:
        sub = f"/dev/shm/kvbucket-test-{uuid.uuid4().hex[:8]}"
        os.mkdir(sub, 0o700)
        try:
            monkeypatch.setenv(env, sub)
            assert xet_uploads.staging_root() == sub
            made = xet_uploads.staging_dir()
            assert made is not None and os.path.dirname(made) == sub
        finally:
            import shutil

            shutil.rmtree(sub)


def test_a_mount_point_in_proc_mounts_is_unescaped() -> None:
    assert xet_uploads._unescape(r"/mnt/my\040disk") == "/mnt/my disk"


def test_room_keeps_an_eighth_of_the_tmpfs_free(monkeypatch: pytest.MonkeyPatch) -> None:
    class St:
        f_frsize, f_blocks = 4096, (8 << 30) // 4096  # an 8 GiB tmpfs

        def __init__(self, free: int) -> None:
            self.f_bavail = free // 4096

    monkeypatch.setattr(os, "statvfs", lambda d: St(2 << 30))
    assert xet_uploads._room_for("/x", 1 << 30)  # 1 GiB left: the eighth is kept
    assert not xet_uploads._room_for("/x", (1 << 30) + 4096)


@needs_shm
def test_a_failed_upload_leaves_no_file_and_nothing_visible(
    store: HFBucketStore, hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = hub_bucket.hub
    log = _recorded(store, monkeypatch)
    hub.faults.add("xorb_upload", status=403)
    (r,) = store.put_many([("f", payload("kv", 2 * MIN, f"fail-{uuid.uuid4()}"))])
    hub.faults.reset()
    assert isinstance(r.error, StoreError) and "HTTP 403" in str(r.error)
    assert [kind for kind, _ in log] == ["file"] and not os.path.exists(log[0][1]["path"])
    assert _left_in_staging() == []
    assert store.head_many(["f"])[0].size is None


@needs_shm
def test_a_timed_out_upload_unlinks_its_files_even_when_hf_xet_never_returns(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit's end is held (as if hf_xet hung after reading the files): the put returns at its
    store deadline, the commit aborted, and the files are gone then, not when hf_xet returns."""
    hub = hub_bucket.hub
    hold = threading.Event()
    with HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/t-{uuid.uuid4().hex[:6]}", token=hub.write_token,
        endpoint=hub.endpoint, token_env="", retry_backoff_secs=0.01, breaker_failures=0,
        store_timeout_secs=5.0,  # room for staging both objects on a loaded machine
    )) as store:
        assert store.put_many([("warm", b"w" * 100)])[0].ok
        log = _recorded(store, monkeypatch, hold)
        try:
            items = [(f"t{i}", payload("kv", 2 * MIN, f"t-{i}-{uuid.uuid4()}")) for i in range(2)]
            results = store.put_many(items)
            assert not any(r.ok for r in results)
            assert [kind for kind, _ in log] == ["file", "file"]
            assert not any(os.path.exists(f["path"]) for _, f in log)
            assert _left_in_staging() == []
        finally:
            hold.set()
        monkeypatch.undo()
        assert store.head_many(["t0", "t1"])[0].size is None  # the aborted commit added nothing


@needs_shm
@pytest.mark.parametrize("threads", [3])
def test_concurrent_puts_of_sizes_around_the_threshold_read_back_their_own_bytes(
    store: HFBucketStore, threads: int
) -> None:
    """Several threads' uploads staged at once (file names never shared): each name reads back
    the bytes its put was given, whichever path each object took."""
    rng = np.random.default_rng()
    errors: list[BaseException] = []
    done: list[list[tuple[str, Any]]] = []

    def run(t: int) -> None:
        try:
            items = [(f"c{t}-{i}", payload("random", int(n), f"c-{t}-{i}-{uuid.uuid4()}"))
                     for i, n in enumerate(rng.integers(MIN - 4096, MIN + 4096, 5))]
            assert all(r.ok for r in store.put_many(items))
            done.append(items)
        except BaseException as e:  # surfaced below
            errors.append(e)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    for items in done:
        _read_back(store, items)
    assert _left_in_staging() == []


_CHILD = """
import sys, time
from kvbucket.stores.hub.xet import uploads as xet_uploads
s = xet_uploads.UploadStaging()
print(s._stage(b"x" * (2 * xet_uploads.STAGE_MIN_BYTES)), flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
"""


@needs_shm
def test_the_staging_directory_goes_at_exit_and_a_killed_process_is_swept_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD, "exit"], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout.strip()
    assert out.startswith("/dev/shm/kvbucket-upload-") and not os.path.exists(os.path.dirname(out))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, "hang"], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert child.stdout is not None
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        monkeypatch.setattr(xet_uploads, "_STALE_SECS", 0.0)
        xet_uploads._sweep("/dev/shm")
        assert os.path.exists(path)  # alive: left alone
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert os.path.exists(path)  # killed: no atexit ran
    xet_uploads._sweep("/dev/shm")
    assert not os.path.exists(os.path.dirname(path))
    mine = xet_uploads.staging_dir()
    assert mine is not None and os.path.isdir(mine)  # this process's own is never swept
    xet_uploads._sweep("/dev/shm")
    assert os.path.isdir(mine)
