"""FileStore behaviour beyond the protocol: crashes, permissions, the temp dir, URLs."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvbucket.errors import ConfigError, InvalidKeyError, NotFoundError, StoreError
from kvbucket.stores import open_store
from kvbucket.stores.local.file import TMP_DIR_NAME, FileStore
from kvbucket.stores.local.open_file import open_file_store

SRC = str(Path(__file__).resolve().parents[2] / "src")
BIG = 32 * 1024 * 1024

# A writer process that dies (SIGKILL, no cleanup) at a chosen point of a put.
_CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    from kvbucket.stores.local.file import FileStore

    root, point = sys.argv[1], sys.argv[2]
    store = FileStore(root)
    store.put("victim", b"\\x01" * {big})        # a complete, acknowledged first version
    real_write = os.write

    def dying_write(fd, data):
        n = real_write(fd, memoryview(data)[: len(data) // 2])  # half of the new version lands
        os.kill(os.getpid(), signal.SIGKILL)
        return n

    def dying_replace(src, dst, **dir_fds):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid-write":
        os.write = dying_write
    else:
        os.replace = dying_replace
    store.put("victim", b"\\x02" * {big})
    print("survived", flush=True)
    """
).format(big=BIG)


def _tmp_files(root: Path) -> list[Path]:
    return sorted((root / TMP_DIR_NAME).iterdir())


@pytest.mark.parametrize("point", ["mid-write", "before-rename"])
def test_crash_leaves_no_partial_object_and_reopen_sweeps_temp(tmp_path: Path, point: str) -> None:
    root = tmp_path / "s"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(root), point],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    leftovers = _tmp_files(root)
    assert len(leftovers) == 1, "the killed writer leaves its temp file behind"
    expected_tmp_size = BIG // 2 if point == "mid-write" else BIG
    assert leftovers[0].stat().st_size == expected_tmp_size

    store = FileStore(root)  # a fresh temp file may belong to a live writer: kept
    assert store.get("victim") == b"\x01" * BIG, "the old complete version is intact"
    assert [(i.name, i.size) for i in store.list()] == [("victim", BIG)], "temp files are never listed"
    assert _tmp_files(root) == leftovers

    old = time.time() - 3600
    os.utime(leftovers[0], (old, old))
    FileStore(root)  # reopening sweeps temp files older than stale_tmp_secs
    assert _tmp_files(root) == []
    assert store.get("victim") == b"\x01" * BIG


def test_sweep_keeps_fresh_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("x", b"1")
    fresh = tmp_path / TMP_DIR_NAME / "fresh"
    fresh.write_bytes(b"in progress")
    assert store.sweep_stale_temp_files(60) == 0 and fresh.exists()
    assert store.sweep_stale_temp_files(-1) == 1 and not fresh.exists()


def test_files_0600_and_dirs_0700(tmp_path: Path) -> None:
    root = tmp_path / "new-root"
    store = FileStore(root)
    store.put_many([("top", b"1"), ("nested/deeper/obj", b"2")])
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(root) == 0o700
    assert mode(root / TMP_DIR_NAME) == 0o700
    assert mode(root / "nested") == 0o700 and mode(root / "nested" / "deeper") == 0o700
    assert mode(root / "top") == 0o600 and mode(root / "nested" / "deeper" / "obj") == 0o600


def test_permissions_ignore_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        FileStore(tmp_path / "r").put("a/b", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r" / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "r" / "a" / "b").stat().st_mode) == 0o600


@pytest.mark.parametrize("name", [TMP_DIR_NAME, f"{TMP_DIR_NAME}/x", f"{TMP_DIR_NAME}/a/b"])
def test_temp_dir_names_refused(tmp_path: Path, name: str) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(InvalidKeyError, match="temp files"):
        store.put_many([("ok", b"1"), (name, b"2")])
    with pytest.raises(InvalidKeyError):
        store.get_many([name])
    with pytest.raises(InvalidKeyError):
        store.delete_many([name])
    assert list(store.list()) == []
    store.put(f"x/{TMP_DIR_NAME}", b"fine below the top level")
    store.put(f"{TMP_DIR_NAME}-not", b"fine as a longer segment")
    assert sorted(i.name for i in store.list()) == [f"{TMP_DIR_NAME}-not", f"x/{TMP_DIR_NAME}"]


def test_temp_files_land_in_hidden_dir_and_are_renamed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put_many([(f"o{i}", b"z" * 100) for i in range(20)])
    assert _tmp_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TMP_DIR_NAME] + [f"o{i}" for i in range(20)])


def test_delete_removes_emptied_dirs_but_not_root(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "r")
    store.put_many([("a/b/c/1", b"1"), ("a/2", b"2")])
    store.delete("a/b/c/1")
    assert not (tmp_path / "r" / "a" / "b").exists()
    assert (tmp_path / "r" / "a" / "2").exists()
    store.delete("a/2")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [TMP_DIR_NAME]


def test_foreign_entries_are_not_objects(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "r")
    store.put("real", b"1")
    outside = tmp_path / "secret"
    outside.write_bytes(b"not in the store")
    (tmp_path / "r" / "link").symlink_to(outside)
    (tmp_path / "r" / "back\\slash").write_bytes(b"invalid name")
    assert [i.name for i in store.list()] == ["real"]
    assert store.get("link") is None and store.head("link") is None
    (r,) = store.delete_many(["link"])
    assert r.ok and r.size is None and outside.exists()
    assert store.get_many(["real"], None)[0].size == 1


def test_directory_is_not_an_object(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("dir/obj", b"1")
    assert store.get("dir") is None and store.head("dir") is None
    assert store.delete_many(["dir"])[0].size is None
    assert store.get("dir/obj") == b"1"


def test_list_order_across_directories(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    names = ["a-c", "a/b", "a0", "a/b0/c", "a/b-", "b", "Z", "é/1", "ab/"[:-1]]
    store.put_many([(n, b"") for n in names])
    assert [i.name for i in store.list()] == sorted(names)
    mtimes = [i.mtime for i in store.list()]
    assert all(isinstance(m, float) and m > 0 for m in mtimes)


def test_list_rejects_bad_page_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="page_size"):
        FileStore(tmp_path).list(page_size=0)


def test_urls_and_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(f"file://{tmp_path}/abs")
    assert isinstance(s, FileStore) and s.root == tmp_path / "abs" and s.url == f"file://{tmp_path}/abs"
    assert isinstance(open_store(str(tmp_path / "bare")), FileStore)
    assert (tmp_path / "bare").is_dir()
    monkeypatch.chdir(tmp_path)
    rel = open_store("file://rel/dir")
    assert isinstance(rel, FileStore) and rel.root == tmp_path / "rel" / "dir"
    rel.put("k", b"v")
    assert (tmp_path / "rel" / "dir" / "k").read_bytes() == b"v"
    assert open_store("file://rel/dir", create="false").get("k") == b"v"


def test_url_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="names no directory"):
        open_file_store("file://")
    with pytest.raises(ConfigError, match="unknown file store option"):
        open_file_store(f"file://{tmp_path}", fsynk=True)
    with pytest.raises(ConfigError, match="true or false"):
        open_file_store(f"file://{tmp_path}", fsync="maybe")
    with pytest.raises(NotFoundError, match="does not exist"):
        open_store(f"file://{tmp_path}/missing", create=False)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        FileStore(tmp_path / "afile")


def test_put_rejects_non_buffers_before_writing(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(TypeError, match="bytes-like"):
        store.put_many([("a", b"1"), ("b", "a str")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="single str"):
        store.get_many("abc")
    assert list(store.list()) == []


def test_write_failure_is_a_per_item_error_and_cleans_its_temp(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("file", b"1")
    store.put("dir/x", b"2")
    results = store.put_many([("file/new", b"2"), ("ok", b"3"), ("dir", b"4")])
    assert "file/new" in str(results[0].error) and "is an object" in str(results[0].error)
    assert results[1].ok and store.get("ok") == b"3"
    assert "dir" in str(results[2].error) and "directory" in str(results[2].error)
    assert _tmp_files(tmp_path) == [], "a failed put removes its temp file"
    assert store.get("file") == b"1" and store.get("dir/x") == b"2"


def test_fsync_covers_files_and_directories_once_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path / "r", fsync=True)
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    results = store.put_many([("top", b"1"), ("new/dir/a", b"2"), ("new/dir/b", b"3")])
    assert all(r.ok for r in results)
    root = str(tmp_path / "r")
    files = [p for p in synced if p.startswith(f"{root}/{TMP_DIR_NAME}/")]
    dirs = [p for p in synced if p not in files]
    assert len(files) == 3, "each object's data is synced before its rename"
    # the renames' directories, plus the parents of the directories this batch created
    assert sorted(dirs) == sorted([root, f"{root}/new/dir", f"{root}/new"])
    synced.clear()
    FileStore(tmp_path / "r2").put("x", b"1")
    assert synced == [], "fsync is off by default"


def test_segment_longer_than_filesystem_limit_is_refused_clearly(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    store.put("d/" + "x" * limit, b"at the limit is fine")
    with pytest.raises(InvalidKeyError, match=f"allows {limit} per file"):
        store.put_many([("ok", b"1"), ("d/" + "é" * (limit // 2 + 1), b"2")])
    assert store.head("ok") is None


def test_concurrent_puts_and_deletes_in_shared_directories(tmp_path: Path) -> None:
    """Deletes prune emptied directories while other threads put into them: no put may fail."""

    store = FileStore(tmp_path)
    errors: list[str] = []
    rounds = 150

    def worker(w: int) -> None:
        for i in range(rounds):
            name = f"shared/{i % 3}/w{w}"
            (r,) = store.put_many([(name, f"{w}-{i}".encode())])
            if not r.ok:
                errors.append(str(r.error))
            elif i % 2:  # odd rounds remove what they wrote, pruning the directory when it empties
                (d,) = store.delete_many([name])
                if not d.ok:
                    errors.append(str(d.error))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # Each name belongs to one worker, so its final state is that of its last round.
    for w in range(4):
        for k in range(3):
            last = max(i for i in range(rounds) if i % 3 == k)
            expected = None if last % 2 else f"{w}-{last}".encode()
            assert store.get(f"shared/{k}/w{w}") == expected


def test_removed_temp_dir_is_recreated(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a", b"1")
    (tmp_path / TMP_DIR_NAME).rmdir()
    assert store.put("b", b"2") == 1
    assert stat.S_IMODE((tmp_path / TMP_DIR_NAME).stat().st_mode) == 0o700


_LOOPING_WRITER = textwrap.dedent(
    """
    import sys
    from kvbucket.stores.local.file import FileStore

    store = FileStore(sys.argv[1])
    big = int(sys.argv[2])
    i = 0
    while True:
        store.put("looped", bytes([i % 251 + 1]) * big)
        i += 1
    """
)


def test_killed_from_outside_while_writing_in_a_loop(tmp_path: Path) -> None:
    """SIGKILL at an arbitrary moment of back-to-back puts: the name always holds one whole value."""
    root = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOOPING_WRITER, str(root), str(BIG)],
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        deadline = time.monotonic() + 30
        while not (root / "looped").exists():  # at least one complete version
            assert time.monotonic() < deadline and proc.poll() is None, "the writer never finished a put"
            time.sleep(0.01)
        # A temp file is being written most of the time: wait until one is there, then kill.
        while not any((root / TMP_DIR_NAME).iterdir()):
            assert time.monotonic() < deadline
        proc.kill()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    store = FileStore(root)
    data = store.get("looped")
    assert data is not None and len(data) == BIG and data == data[:1] * BIG, "a torn or partial value"
    assert [i.name for i in store.list()] == ["looped"]


def test_sweep_skips_what_it_cannot_remove(tmp_path: Path) -> None:
    FileStore(tmp_path).put("a", b"1")
    odd = tmp_path / TMP_DIR_NAME / "a-directory"
    odd.mkdir()
    stale = tmp_path / TMP_DIR_NAME / "stale"
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(odd, (old, old))
    os.utime(stale, (old, old))
    store = FileStore(tmp_path)  # must open despite the directory it cannot unlink
    assert odd.exists() and not stale.exists()
    assert store.get("a") == b"1"


def test_unwritable_root_is_a_store_error(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    store = FileStore(root)
    (root / TMP_DIR_NAME).write_bytes(b"a file where the temp dir should be")
    with pytest.raises(StoreError, match="cannot write to store directory"):
        store.put("x", b"1")


def test_delete_version_gives_back_a_file_written_between_compare_and_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one moment a directory's version delete could take a newer file: a writer's rename
    between the compare and the delete's own rename. The moved file is compared again and linked
    back (stores/local/versions.py)."""
    from kvbucket.stores.local import versions

    s = FileStore(tmp_path)
    s.put("a/n", b"v1")
    (v1,) = s.get_versions(["a/n"])
    real_rename = os.rename

    def racing(*args: Any, **kw: Any) -> None:
        FileStore(tmp_path).put("a/n", b"v2, written just now")
        real_rename(*args, **kw)

    monkeypatch.setattr(versions.os, "rename", racing)
    (r,) = s.delete_versions([("a/n", str(v1.version))])
    assert r.ok and r.changed and not r.removed
    assert s.get("a/n") == b"v2, written just now"
    assert not os.listdir(tmp_path / TMP_DIR_NAME)  # no tomb left behind


def test_delete_version_drops_a_file_superseded_while_it_was_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvbucket.stores.local import versions

    s = FileStore(tmp_path)
    s.put("n", b"v1")
    (v1,) = s.get_versions(["n"])
    real_rename, real_link = os.rename, os.link

    def racing_rename(*args: Any, **kw: Any) -> None:
        FileStore(tmp_path).put("n", b"v2")
        real_rename(*args, **kw)

    def racing_link(*args: Any, **kw: Any) -> None:
        FileStore(tmp_path).put("n", b"v3, the newest")
        real_link(*args, **kw)

    monkeypatch.setattr(versions.os, "rename", racing_rename)
    monkeypatch.setattr(versions.os, "link", racing_link)
    (r,) = s.delete_versions([("n", str(v1.version))])
    assert r.changed and s.get("n") == b"v3, the newest"
    assert not os.listdir(tmp_path / TMP_DIR_NAME)
