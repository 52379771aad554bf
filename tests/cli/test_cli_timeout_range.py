"""``--timeout inf`` / ``1e300`` (issue 40, outside tester F6): the watchdog thread crashed with
OverflowError (exit 1, a traceback) and doctor printed "timestamp out of range" for every
endpoint. docs/cli.md: --timeout takes 0.1 to 604800 s; anything else is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import assert_one_line_error, run_cli


@pytest.mark.parametrize("value", ["inf", "1e300", "604801"])
@pytest.mark.parametrize("command", [["ls", "bob/kv"], ["doctor"], ["du", "bob/kv"]])
def test_a_timeout_past_a_week_is_refused_in_one_line(
    command: list[str], value: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    r = run_cli(*command, "--timeout", value, env=cli_env, cwd=tmp_path, timeout=30)
    assert_one_line_error(r, 2, "--timeout", "604800")
    assert "OverflowError" not in r.err + r.out


def test_a_timeout_of_a_week_is_taken(cli_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    r = run_cli("ls", str(tmp_path / "store"), "--timeout", "604800", env=cli_env, timeout=30)
    assert r.code == 0, (r.code, r.out, r.err)
