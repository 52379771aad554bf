"""Every command and subcommand of the installed ``kvbucket`` script shows its help.

Commands are discovered from the ``--help`` output of the script itself (and cross-checked
against the typer app, so a parsing slip cannot hide one); each ``--help`` runs in its own
process, as a user would type it. No help page points to docs files: a wheel user has no
docs/*.md (this sweep is the one that reads every help page; test_cli_smalls40.py checks the
warnings).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import typer
from cli_run import run_cli

from kvbucket.cli import build_app

_COMMAND_LINE = re.compile(r"^  (\S+)(\s{2,}|$)")


def _listed_commands(help_text: str) -> list[str]:
    """Names in the ``Commands:`` section of a click help page."""
    names, inside = [], False
    for line in help_text.splitlines():
        if line.rstrip() == "Commands:":
            inside = True
        elif inside and line and not line.startswith(" "):
            inside = False
        elif inside and (m := _COMMAND_LINE.match(line)):
            names.append(m.group(1))
    return names


def _tree_from_app() -> set[tuple[str, ...]]:
    root = typer.main.get_command(build_app())
    paths: set[tuple[str, ...]] = set()

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        paths.add(path)
        if hasattr(cmd, "commands"):  # a group (typer runs on its own copy of click)
            for name, sub in cmd.commands.items():
                if not sub.hidden:
                    walk(sub, (*path, name))

    walk(root, ())
    return paths


@pytest.mark.slow(16)
def test_every_command_shows_its_help_in_a_subprocess(cli_env: dict[str, str]) -> None:
    seen: dict[tuple[str, ...], str] = {}
    frontier: list[tuple[str, ...]] = [()]
    with ThreadPoolExecutor(2) as pool:
        while frontier:
            runs = list(pool.map(lambda p: (p, run_cli(*p, "--help", env=cli_env)), frontier))
            frontier = []
            for path, r in runs:
                shown = " ".join(("kvbucket", *path))
                assert r.code == 0, f"`{shown} --help` exited {r.code}:\n{r.err}"
                assert "Traceback" not in r.err + r.out, f"`{shown} --help`:\n{r.err}"
                assert "Error" not in r.err, f"`{shown} --help`:\n{r.err}"
                assert r.out.startswith(f"Usage: {shown} "), r.out[:200]
                assert not re.search(r"\.md\b|docs/", r.out), (shown, r.out)  # a wheel user has no docs/
                seen[path] = r.out
                frontier += [(*path, name) for name in _listed_commands(r.out)]
    assert set(seen) == _tree_from_app()
    assert len(seen) >= 17  # root, 8 top-level commands/groups, compile-cache's 7, emulator serve


def test_help_shows_urls_with_brackets_literally() -> None:
    r = run_cli("ls", "--help")
    assert r.code == 0, r.err
    assert "hf://buckets/ns/name[/prefix]" in r.out


def test_no_arguments_prints_the_command_list() -> None:
    r = run_cli()
    assert "Commands:" in r.out + r.err and "Traceback" not in r.err
    assert r.code in (0, 2)
