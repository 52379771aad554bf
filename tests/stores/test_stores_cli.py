"""``kvbucket ls|du|rm`` through typer's CliRunner against real FileStores."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvbucket.stores as stores_pkg
from kvbucket.cli import build_app
from kvbucket.cli.store_cmd import RM_BATCH, display_key, human_size
from kvbucket.errors import StoreError
from kvbucket.keys import CacheEngineKey, ObjectKey, key_to_name
from kvbucket.stores.base import ItemResult
from kvbucket.stores.local.file import FileStore

runner = CliRunner()
KEY = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, -0x41257AF1DD85C366, "bfloat16")
OKEY = ObjectKey("Qwen/Qwen3-0.6B", 0x01000100, bytes.fromhex("00ff10"), "tenant-a")


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(build_app(), list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def filled(tmp_path: Path) -> str:
    store = FileStore(tmp_path / "s")
    store.put_many(
        [
            (key_to_name(KEY, "kv"), b"x" * 2048),
            (key_to_name(OKEY), b"y" * 100),
            ("plain/name.bin", b"z" * 5),
        ]
    )
    return f"file://{tmp_path}/s"


def test_ls_lists_names_and_sizes(filled: str) -> None:
    code, out, _ = run("ls", filled)
    assert code == 0
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["100", "2048", "5"]
    assert [ln.split(maxsplit=1)[1] for ln in lines] == [
        key_to_name(OKEY), key_to_name(KEY, "kv"), "plain/name.bin"
    ]


def test_ls_keys_decodes_encoded_names_and_keeps_others(filled: str) -> None:
    code, out, _ = run("ls", filled, "--keys")
    assert code == 0
    shown = [ln.split(maxsplit=1)[1] for ln in out.splitlines()]
    assert shown == [OKEY.to_string(), f"kv/{KEY.to_string()}", "plain/name.bin"]
    assert CacheEngineKey.from_string(shown[1].removeprefix("kv/")) == KEY


def test_ls_prefix(filled: str) -> None:
    code, out, _ = run("ls", filled, "--prefix", "kv/")
    assert code == 0 and out.splitlines() == [f"{2048:>12}  {key_to_name(KEY, 'kv')}"]


def test_du_counts_objects_and_bytes(filled: str) -> None:
    code, out, _ = run("du", filled)
    assert code == 0
    assert out.startswith("3 objects, 2153 bytes (2.1 KiB)")
    code, out, _ = run("du", filled, "-p", "plain")
    assert code == 0 and out.startswith("1 object, 5 bytes (5 B)")


def test_rm_names_counts_only_what_existed(filled: str, tmp_path: Path) -> None:
    code, out, _ = run("rm", filled, "plain/name.bin", "never/was")
    assert code == 0
    assert out.strip() == "removed 1, 1 not found"
    assert FileStore(tmp_path / "s").head("plain/name.bin") is None


def test_rm_prefix_needs_yes(filled: str, tmp_path: Path) -> None:
    code, _, err = run("rm", filled, "--prefix", "kv/")
    assert code == 2 and "--yes" in err
    assert FileStore(tmp_path / "s").head(key_to_name(KEY, "kv")) == 2048, "nothing removed without --yes"
    code, out, _ = run("rm", filled, "--prefix", "kv/", "--yes")
    assert code == 0 and out.strip() == "removed 1"
    assert [i.name for i in FileStore(tmp_path / "s").list()] == [key_to_name(OKEY), "plain/name.bin"]


def test_rm_everything_in_batches(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "many")
    n = RM_BATCH + 7
    store.put_many([(f"d{i % 3}/o{i}", b"") for i in range(n)])
    code, _, err = run("rm", str(tmp_path / "many"), "--prefix", "")
    assert code == 2 and "EVERY object" in err
    code, out, _ = run("rm", str(tmp_path / "many"), "--prefix", "", "--yes")
    assert code == 0 and out.strip() == f"removed {n}"
    assert list(store.list()) == []


class _RefusingStore(FileStore):
    """A FileStore whose deletes of names containing "locked" fail, as a remote store's can."""

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        refused = {n for n in names if "locked" in n}
        done = iter(super().delete_many([n for n in names if n not in refused]))
        return [
            ItemResult(n, error=StoreError(f"permission denied for {n!r}")) if n in refused else next(done)
            for n in names
        ]


def open_refusing(url: str, **options: object) -> _RefusingStore:
    return _RefusingStore(url.removeprefix("refusing://"), create=bool(options.get("create", True)))


def test_rm_per_item_error_exits_nonzero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(stores_pkg._OPENERS, "refusing", f"{__name__}:open_refusing")
    FileStore(tmp_path / "r").put_many([("a", b"1"), ("locked/b", b"2"), ("c", b"3")])
    code, out, err = run("rm", f"refusing://{tmp_path}/r", "a", "locked/b", "c")
    assert code == 1
    assert "locked/b" in err and "permission denied" in err
    assert out.strip() == "removed 2, 1 failed"
    assert [i.name for i in FileStore(tmp_path / "r").list()] == ["locked/b"]


def test_rm_invalid_name_refused_whole_call(filled: str) -> None:
    code, _, err = run("rm", filled, "plain/name.bin", "../escape")
    assert code == 2 and err.startswith("error: ") and "escape" in err and "Traceback" not in err
    assert FileStore(filled.removeprefix("file://")).head("plain/name.bin") == 5


def test_rm_argument_errors(filled: str) -> None:
    code, _, err = run("rm", filled)
    assert code == 2 and "nothing to remove" in err
    code, _, err = run("rm", filled, "a", "--prefix", "b")
    assert code == 2 and "not both" in err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nosuch://x", "unknown store URL scheme"),
        ("file://", "names no directory"),
    ],
)
def test_bad_urls_exit_2_with_one_line(url: str, message: str) -> None:
    for cmd in ("ls", "du"):
        code, out, err = run(cmd, url)
        assert code == 2 and out == ""
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_missing_directory_is_not_created(tmp_path: Path) -> None:
    for cmd in (["ls"], ["du"], ["rm", "--prefix", "", "--yes"]):
        code, _, err = run(cmd[0], str(tmp_path / "absent"), *cmd[1:])
        assert code == 2 and "does not exist" in err
    assert not (tmp_path / "absent").exists()


def test_memory_url_works(tmp_path: Path) -> None:
    code, out, _ = run("du", "memory://scratch")
    assert code == 0 and out.startswith("0 objects, 0 bytes")


def test_helpers() -> None:
    assert human_size(0) == "0 B" and human_size(1023) == "1023 B"
    assert human_size(2 * 1024**2) == "2.0 MiB" and human_size(3 * 1024**5) == "3072.0 TiB"
    assert display_key("not%zzencoded") == "not%zzencoded"
    assert display_key(key_to_name(KEY, "a/b")) == f"a/b/{KEY.to_string()}"


def test_ls_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    FileStore(tmp_path / "p").put_many([(f"o{i:05d}", b"") for i in range(6000)])
    proc = subprocess.run(
        f"{sys.executable} -m kvbucket ls {tmp_path / 'p'} | head -n 2",
        shell=True, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )
    assert proc.stdout.splitlines() == [f"{0:>12}  o00000", f"{0:>12}  o00001"]
    assert proc.stderr == ""
