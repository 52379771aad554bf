"""Run the installed ``kvbucket`` console script in a subprocess, as a user would (CLI tests' helpers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KVBUCKET = Path(sys.executable).with_name("kvbucket")


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]


def cli_environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment plus ``env``: the child keeps PYTHONPATH (so in a worktree it runs the
    worktree's src, not the code the venv's install points at) and PATH."""
    return {**os.environ, "COLUMNS": "100", **(env or {})}


def clean_env(config_dir: Path) -> dict[str, str]:
    """A private config dir and no cloud credentials or endpoints from the developer's shell (the
    ``cli_env`` fixture; module-scoped fixtures call it themselves)."""
    env = {"KVBUCKET_CONFIG_DIR": str(config_dir), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("HF_TOKEN", "HF_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                 "AWS_SESSION_TOKEN", "AWS_PROFILE", "KVBUCKET_COMPILE_CACHE", "KVBUCKET_LOG_LEVEL"):
        env[name] = ""
    return env


def run_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0,
            cwd: str | Path | None = None, wrapper: Sequence[str] = ()) -> Run:
    """``kvbucket ARGS`` in a child process with this environment (plus ``env``), run through
    ``wrapper`` when given (e.g. ``setpriv ...``)."""
    p = subprocess.run([*wrapper, str(KVBUCKET), *args], capture_output=True, text=True, env=cli_environ(env),
                       timeout=timeout, cwd=cwd)
    return Run(p.returncode, p.stdout, p.stderr)


def start_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``kvbucket ARGS`` started as :func:`run_cli` runs it (a server: the caller reads its
    merged stdout and stderr, and stops it)."""
    return subprocess.Popen([str(KVBUCKET), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cli_environ(env))


def assert_one_line_error(r: Run, code: int, *needles: str) -> str:
    """The error contract: exit ``code``, one ``error:`` line on stderr naming the fix, no traceback."""
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    assert len(r.err_lines) == 1, r.err
    line = r.err_lines[0]
    assert line.startswith("error: "), line
    for n in needles:
        assert n.lower() in line.lower(), (n, line)
    return line
