"""``compile-cache`` on a directory target that is missing or unreadable: one ``error:`` line,
exit 2 (the environment needs fixing), nothing created (issue 24, item 17). Run as the installed
script."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, run_cli


def _unprivileged() -> list[str]:
    """How to run the script without the power to read any file (root has it through capabilities)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory unreadable")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("cmd", [
    ["compile-cache", "fetch", "--layout", "torch"],
    ["compile-cache", "sync", "--layout", "torch"],
    ["compile-cache", "lookup", "org/model"],
    ["compile-cache", "set"],
])
def test_a_missing_target_directory_is_refused_and_not_created(cmd: list[str], cli_env: dict[str, str],
                                                                tmp_path: Path) -> None:
    target = tmp_path / "nosuch"
    extra = ["--cache-dir", str(tmp_path / "local")] if cmd[1] in ("fetch", "sync") else []
    args = [*cmd, str(target)] if cmd[1] == "set" else [*cmd, *extra, "--target", str(target)]
    r = run_cli(*args, env=cli_env, cwd=tmp_path)
    assert_one_line_error(r, 2, f"{target} does not exist", "kvbucket compile-cache create")
    assert not target.exists()


@pytest.mark.parametrize("cmd", [
    ["compile-cache", "fetch", "--layout", "torch"],
    ["compile-cache", "sync", "--layout", "torch"],
    ["ls"],
])
def test_an_unreadable_store_directory_is_exit_2_with_the_fix(cmd: list[str], cli_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    wrapper = _unprivileged()
    store = tmp_path / "store"
    store.mkdir()
    (store / "entry").write_bytes(b"x")
    store.chmod(0)
    try:
        if cmd[0] == "ls":
            args = [*cmd, str(store)]
        else:
            args = [*cmd, "--cache-dir", str(tmp_path / "local"), "--target", str(store)]
        r = run_cli(*args, env=cli_env, cwd=tmp_path, wrapper=wrapper)
    finally:
        store.chmod(0o700)
    line = assert_one_line_error(r, 2, f"permission denied on {store}", "chmod")
    assert "Errno" not in line
