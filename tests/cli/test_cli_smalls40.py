"""Issue 40 item 8, the CLI's small surprises, each run as the installed console script: a
namespace listing, pointers for `hf`'s options, an empty listing, whole command summaries in a
pipe, one version line, no pointers to docs/*.md a wheel user lacks, a misspelt hf:// scheme, a
bad KVBUCKET_* value in the synthetic demo, and the docs' wording."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[2]
HF = Path(sys.executable).with_name("hf")


@pytest.fixture
def hub_env(hub_emulator: Any, cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**cli_env, "HF_ENDPOINT": hub_emulator.endpoint, "HF_TOKEN": hub_emulator.write_token,
            "HF_HOME": str(tmp_path / "hf-home"), "HF_XET_CACHE": str(tmp_path / "xet")}


def test_ls_a_namespace_lists_its_buckets_as_hf_does(hub_emulator: Any, hub_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    ns = hub_emulator.namespace
    made = sorted(f"{ns}/ns-{uuid.uuid4().hex[:6]}-{i}" for i in range(2))
    for b in made:
        hub_emulator.api().create_bucket(b, private=True)
    hf = subprocess.run([str(HF), "buckets", "ls", ns, "-q"], capture_output=True, text=True, timeout=120,
                        env={**os.environ, **hub_env})
    assert hf.returncode == 0, hf.stderr
    for arg in (ns, "me"):
        r = run_cli("ls", arg, "-q", env=hub_env, cwd=tmp_path)
        assert r.code == 0, r.err
        assert sorted(r.out.split()) == sorted(hf.stdout.split()) and set(made) <= set(r.out.split()), r.out
    table = run_cli("ls", ns, env=hub_env, cwd=tmp_path)
    assert any(ln.endswith(f"{made[0]}  (private)") for ln in table.out.splitlines()), table.out
    doc = json.loads(run_cli("ls", ns, "--json", env=hub_env, cwd=tmp_path).out)
    assert {d["id"] for d in doc} >= set(made) and all(d["private"] for d in doc if d["id"] in made)
    missing = run_cli("ls", "no-such-namespace-40", env=hub_env, cwd=tmp_path)
    assert_one_line_error(missing, 2, "no Hub namespace 'no-such-namespace-40'", "./no-such-namespace-40")
    (tmp_path / "localdir").mkdir()  # an existing directory stays the directory
    local = run_cli("ls", "localdir", env=hub_env, cwd=tmp_path)
    assert local.code == 0 and local.out == "(empty)\n", local.out + local.err


@pytest.mark.parametrize(("args", "needles"), [
    (["ls", "-R"], ["always recursive", "drop -R"]),
    (["ls", "--recursive"], ["always recursive"]),
    (["ls", "--token", "hf_x"], ["$HF_TOKEN", "hf auth login"]),
    (["du", "--token=hf_x"], ["$HF_TOKEN"]),
    (["ls", "--human-readable"], ["bytes", "kvbucket du"]),
    (["du", "-q"], ["one summary line", "--format json"]),
    (["rm", "--recursive"], ["--prefix P", "--yes"]),
    (["rm", "-r"], ["--prefix P", "--dry-run"]),
    (["rm", "-R"], ["--prefix P", "it needs --yes to remove"]),  # F12: rm never asks a question
])
def test_hf_options_get_a_pointer(args: list[str], needles: list[str], cli_env: dict[str, str],
                                  tmp_path: Path) -> None:
    r = run_cli(*args[:1], str(tmp_path), *args[1:], env=cli_env)
    line = assert_one_line_error(r, 2, "no such option", *needles)
    assert "Possible options" not in line and "skip the question" not in line


@pytest.mark.parametrize("cmd", [["ls"], ["du"], ["verify"], ["doctor"], ["stats"]])
def test_hfs_agent_format_gets_a_pointer_to_json(
    cmd: list[str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    """`hf ... --format agent` is hf 2.4's output for agents; kvbucket's machine output is --json."""
    hf_help = subprocess.run([str(HF), "buckets", "ls", "--help"], capture_output=True, text=True,
                             env={**os.environ, **cli_env, "COLUMNS": "200"}).stdout
    assert "agent" in hf_help, hf_help  # a value users of hf type
    where = [str(tmp_path)] if cmd[0] in ("ls", "du", "verify") else []
    for value in ("agent", "AGENT"):
        r = run_cli(*cmd, *where, "--format", value, env=cli_env)
        line = assert_one_line_error(r, 2, "no agent format", "--json", "--format json")
        assert "did you mean" not in line, line
    human = assert_one_line_error(run_cli(*cmd, *where, "--format", "human", env=cli_env), 2, "table")
    assert "drop --format" in human, human


def test_an_empty_listing_says_so(cli_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for extra in ([], ["--prefix", "kv/"]):  # as `hf buckets ls` prints an empty listing
        r = run_cli("ls", str(tmp_path / "empty"), *extra, env=cli_env)
        assert r.code == 0 and r.out == "(empty)\n" and not r.err_lines, r.out + r.err
    assert run_cli("ls", str(tmp_path / "empty"), "--json", env=cli_env).out.strip() == "[]"
    assert run_cli("ls", str(tmp_path / "empty"), "-q", env=cli_env).out == ""


def test_command_summaries_are_whole_in_a_pipe(cli_env: dict[str, str]) -> None:
    r = run_cli("-h", env={**cli_env, "COLUMNS": "80"})
    commands = r.out.split("Commands:", 1)[1]
    assert "..." not in commands, commands
    flat = " ".join(commands.split())
    assert "Remove objects by name or cache key, every object under --prefix (needs --yes), or one model " \
           "identity's chunks (--model and --identity)." in flat, flat
    assert "..." not in run_cli("compile-cache", "-h", env=cli_env).out.split("Commands:", 1)[1]


def test_version_and_dash_v_print_the_same(cli_env: dict[str, str]) -> None:
    assert run_cli("version", env=cli_env).out == run_cli("-V", env=cli_env).out == \
        run_cli("--version", env=cli_env).out


def test_help_and_warnings_never_point_to_docs_files(cli_env: dict[str, str]) -> None:
    """A wheel user has no docs/*.md: help, warnings and errors say it in words. Every command's
    help page is read (and checked for docs paths) by test_cli_help.py's sweep of the whole
    command tree, which runs each ``--help`` once; here the root help and a warning."""
    r = run_cli("--help", env=cli_env)
    assert r.code == 0 and "Commands:" in r.out, r.err
    assert not re.search(r"\.md\b|docs/", r.out), r.out
    r = run_cli("version", env={**cli_env, "KVBUCKET_NO_SUCH_SETTING": "1"})
    assert "KVBUCKET_NO_SUCH_SETTING" in r.err and not re.search(r"\.md\b|docs/", r.err), r.err


@pytest.mark.parametrize(("url", "meant"), [
    ("hf://bucket/alice/kv", "hf://buckets/alice/kv"),
    ("hf://bukets/alice/kv/llama", "hf://buckets/alice/kv/llama"),
    ("hf://alice/kv", "hf://buckets/alice/kv"),
])
def test_a_misspelt_hf_scheme_suggests_the_right_url(url: str, meant: str, cli_env: dict[str, str]) -> None:
    line = assert_one_line_error(run_cli("ls", url, env=cli_env), 2, f"did you mean {meant}?")
    assert "Config" not in line and "bucket_handle" not in line and "hf://buckets/bucket" not in line, line


@pytest.mark.parametrize("url", ["hf://datasets/alice/kv", "hf://spaces/alice/app/x", "hf://models/alice/m"])
def test_a_repository_url_is_not_taken_for_a_bucket(url: str, cli_env: dict[str, str]) -> None:
    """An outside check: hf://datasets/alice/kv suggested hf://buckets/datasets/alice/kv."""
    line = assert_one_line_error(run_cli("ls", url, env=cli_env), 2, "Hub repository", "hf buckets create")
    assert "did you mean" not in line and "buckets/datasets" not in line, line


def test_the_synthetic_demo_refuses_a_bad_env_value(cli_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("chunk_size: 256\n")
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--config", str(config),
                env={**cli_env, "KVBUCKET_LOCAL_CPU": "maybe"})
    assert_one_line_error(r, 2, "KVBUCKET_LOCAL_CPU", "'maybe'", "true or false")


def test_docs_describe_what_the_seeds_were() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        assert not re.search(r"\bseeds?\b'? ?(\d{3}\b|'s\b)|seed defect", text, re.IGNORECASE), path
    readme = (ROOT / "README.md").read_text()
    assert "`make demo`" in readme and "It takes minutes" in readme


def test_readme_says_how_long_make_demo_takes_the_first_time_and_later() -> None:
    """An outside check re-timed `make demo` on a fresh clone: the README's one figure ("about 5"
    minutes, "some 100 s" of install) did not say what a later run or a quiet machine takes."""
    readme = (ROOT / "README.md").read_text()
    para = readme[readme.index("`make demo`: two"):readme.index("`make test` is what CI runs")]
    flat = " ".join(para.split())
    for needle in ("The first run creates `.venv`", "Later runs skip the install",
                   "on a quiet 2-core machine", "when those cores are shared",
                   "first run 4 min 54 s, the next 4 min 57 s"):
        assert needle in flat, (needle, flat)


def test_demo_exit_codes_are_the_ones_docs_backends_md_gives(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Issue 40 (outside tester F12): docs/backends.md said an unreachable store exits 2; like
    every command, the demo exits 1 for a store that cannot be reached and 2 for a bad input."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    assert "1 if any byte differs or the store is unreachable" in " ".join(doc.split())
    env = {**cli_env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    down = run_cli("demo", "--synthetic", "--chunks", "1", "--target", "hf://buckets/alice/kv",
                   "--timeout", "5", env=env, cwd=tmp_path)
    assert_one_line_error(down, 1, "connection refused")
    bad = run_cli("demo", "--synthetic", "--chunks", "1", "--target", "gopher://x/y", env=env, cwd=tmp_path)
    assert bad.code == 2, (bad.out, bad.err)
