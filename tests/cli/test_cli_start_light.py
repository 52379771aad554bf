"""``kvbucket --version``, ``--help`` and every command's ``--help`` start without the heavy libraries.

The test suite runs the console script hundreds of times and users run it in scripts, so its
start-up is paid on every call: a command imports the stores, clients and config models it needs
when it runs (inside its function), never when the app is built or a help page is shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_run import KVBUCKET

#: what no help page and no ``--version`` may import (a module or a package and its submodules).
#: pydantic is not listed: typer (0.29) builds a pydantic TypeAdapter for each parameter it processes,
#: and a sub-command's parse processes the root's unset --install-completion; kvbucket's own
#: pydantic models (the engine config, the keyring) are listed.
HEAVY = (
    "numpy", "torch", "numba", "lmcache", "huggingface_hub", "hf_xet", "obstore", "pycurl",
    "prometheus_client", "yaml",
    "kvbucket.stores.hub", "kvbucket.stores.s3", "kvbucket.stores.guard", "kvbucket.stores.local.file",
    "kvbucket.l2", "kvbucket.engine_config", "kvbucket.config", "kvbucket.encryption", "kvbucket.backends",
    "kvbucket.metrics", "kvbucket.compile_cache", "kvbucket.fleet", "kvbucket.demo", "kvbucket.testing",
)


def heavy(modules: list[str]) -> list[str]:
    """The entries of :data:`HEAVY` that ``modules`` holds (itself or a submodule)."""
    return sorted({h for m in modules for h in HEAVY if m == h or m.startswith(h + ".")})


def clean_env(cli_env: dict[str, str]) -> dict[str, str]:
    """This environment without the developer's ``KVBUCKET_*`` variables (a misspelt one is warned
    about, which takes the engine config), plus the CLI tests' private config dir."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVBUCKET_")}, **cli_env}


def imported_by_console_script(env: dict[str, str], *args: str) -> list[str]:
    """The modules ``kvbucket ARGS`` imports, as ``python -X importtime`` lists them (exit 0 asserted)."""
    p = subprocess.run([sys.executable, "-X", "importtime", str(KVBUCKET), *args], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip(), p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    return [ln.rsplit("|", 1)[1].strip() for ln in lines if not ln.rstrip().endswith("imported package")]


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("ls", "--help"), ("version",)])
def test_the_console_script_starts_without_heavy_modules(args: tuple[str, ...],
                                                         cli_env: dict[str, str]) -> None:
    modules = imported_by_console_script(clean_env(cli_env), *args)
    assert "kvbucket.cli" in modules and "typer" in modules, modules[-20:]  # the parse saw real lines
    assert heavy(modules) == [], f"kvbucket {' '.join(args)} imported {heavy(modules)}"
    if args in (("--version",), ("--help",)):  # nothing parsed past the root's own flags: no typer adapter
        assert "pydantic" not in modules, f"kvbucket {' '.join(args)} imported pydantic"


#: runs every command path's --help through kvbucket.cli.main in one process; prints what each imported
_SWEEP = """
import contextlib, io, json, sys
import typer
from kvbucket.cli import build_app, main

def walk(cmd, path):
    yield path
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        yield from walk(sub, (*path, name))

paths = list(walk(typer.main.get_command(build_app()), ()))
out = {}
for path in paths:
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        main([*path, "--help"])
    out[" ".join(path)] = {"help": shown.getvalue()[:200], "modules": sorted(sys.modules)}
print(json.dumps(out))
"""


def test_every_help_page_is_shown_without_heavy_modules(cli_env: dict[str, str]) -> None:
    p = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True, timeout=120,
                       env=clean_env(cli_env))
    assert p.returncode == 0, p.stderr[-2000:]
    pages = json.loads(p.stdout)
    assert {"", "ls", "du", "rm", "migrate", "verify", "doctor", "stats", "demo", "version",
            "compile-cache fetch", "emulator serve"} <= set(pages), sorted(pages)
    for path, page in pages.items():
        assert "Usage: kvbucket" in page["help"], (path, page["help"])
        assert heavy(page["modules"]) == [], f"kvbucket {path} --help imported {heavy(page['modules'])}"
