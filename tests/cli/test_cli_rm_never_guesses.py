"""`kvbucket rm` never guesses (issue 39): text that is both a directory here and a bucket id is
refused, every rm says first what it resolved to, and Ctrl-C in a prefix removal says how many
went. Run as a user runs it: the installed console script, from a directory of the test's own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cli_run import KVBUCKET, Run, assert_one_line_error, run_cli

from kvbucket.stores import open_store

N_OBJECTS = 2_000


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A working directory holding ./alice/kv/notes.txt, a file kvbucket never wrote."""
    cwd = tmp_path / "work"
    (cwd / "alice" / "kv").mkdir(parents=True)
    (cwd / "alice" / "kv" / "notes.txt").write_text("mine\n")
    return cwd


@pytest.mark.parametrize("args", [
    ["--prefix", "", "--yes"], ["--prefix", "", "--dry-run"], ["notes.txt"],
    ["--model", "m", "--identity", "none"],
])
def test_rm_refuses_a_name_that_is_both_a_directory_here_and_a_bucket_id(
    args: list[str], here: Path, cli_env: dict[str, str]
) -> None:
    r = run_cli("rm", "alice/kv", *args, env=cli_env, cwd=here)
    line = assert_one_line_error(r, 2, "does not guess", "./alice/kv", "hf://buckets/alice/kv")
    assert "./alice exists here" in line
    assert (here / "alice" / "kv" / "notes.txt").read_text() == "mine\n"  # nothing removed
    assert r.out == ""


def test_verify_delete_bad_refuses_it_too_and_verify_alone_reads_the_directory(
    here: Path, cli_env: dict[str, str]
) -> None:
    r = run_cli("verify", "alice/kv", "--delete-bad", env=cli_env, cwd=here)
    assert_one_line_error(r, 2, "verify --delete-bad does not guess", "./alice/kv", "hf://buckets/alice/kv")
    assert (here / "alice" / "kv" / "notes.txt").exists()
    r = run_cli("verify", "alice/kv", env=cli_env, cwd=here)  # reading only: the directory, as before
    assert "notes.txt" in r.out + r.err and "does not guess" not in r.err


def test_each_way_of_writing_it_is_taken_as_written(here: Path, cli_env: dict[str, str],
                                                    hub_bucket: Any) -> None:
    r = run_cli("rm", "./alice/kv", "--prefix", "", "--dry-run", env=cli_env, cwd=here)
    assert r.code == 0, r.err
    assert r.err_lines[0] == f"dry run on the directory {here / 'alice' / 'kv'}"
    assert r.out.splitlines() == ["would remove notes.txt (5 bytes)", "(dry run) would remove 1"]
    hub = hub_bucket.hub
    env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token}
    r = run_cli("rm", f"hf://buckets/{hub_bucket.bucket_id}", "--prefix", "", "--yes", env=env, cwd=here)
    assert r.code == 0, r.err
    assert r.err_lines[0] == (f"removing from the Hub bucket {hub_bucket.bucket_id} at {hub.endpoint} "
                              "($HF_ENDPOINT)")
    assert r.out.strip() == "removed 0"
    assert (here / "alice" / "kv" / "notes.txt").exists()


def _default_sigint() -> None:
    """In the child before exec: SIGINT delivered and at its default. A process started with SIGINT
    ignored (or blocked) keeps it so (Python installs KeyboardInterrupt only over the default), and
    something in the full suite leaves the xdist worker so: this test failed in three full runs with
    exit 0, "removed 2000", as it does when run from a process that ignores SIGINT."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_prefix_removal_says_how_many_were_removed(
    hub_bucket: Any, hub_faults: Any, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """2,000 objects, removed 1,000 per batch, each batch delayed 4 s by the emulator: SIGINT
    once the progress line shows the first batch gone."""
    hub = hub_bucket.hub
    url = f"hf://buckets/{hub_bucket.bucket_id}"
    with open_store(url, endpoint=hub.endpoint, token=hub.write_token, token_env="", prestart=False) as store:
        assert all(r.ok for r in store.put_many([(f"p/{i:05d}", b"x") for i in range(N_OBJECTS)]))
    hub_faults.add("batch", latency_s=4.0)
    env = {**os.environ, **cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token,
           "KVBUCKET_PROGRESS_INTERVAL": "0.05"}
    # The child starts with Ctrl-C's default disposition, unblocked, as from a shell (_default_sigint)
    proc = subprocess.Popen([str(KVBUCKET), "rm", url, "--prefix", "p/", "--yes"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line.rstrip("\n"))
            if ": 1,000 objects," in line:  # the first batch is gone; the second listed, then sent
                # SIGINT once the emulator holds the second batch in its 4 s delay (its rule has seen
                # it): a fixed 1 s sleep here raced the second batch under -n 2 (exit 0 in two runs)
                while time.monotonic() < deadline and sum(r.get("seen", 0) for r in hub_faults.rules()) < 2:
                    time.sleep(0.05)
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                break
        out, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = Run(proc.returncode, out, "\n".join(seen) + "\n" + rest)
    assert seen and seen[0].startswith(f"removing from the Hub bucket {hub_bucket.bucket_id} at "), r.err
    assert r.code == 130, (r.code, r.err)
    assert "Traceback" not in r.err
    last = r.err_lines[-1]
    assert last.startswith("interrupted: removed 1,000 objects; "), r.err
    assert last.endswith("the others were not removed (run the same command again to go on)"), r.err
    assert r.err_lines[-2].endswith("(interrupted)"), r.err  # the progress line says it did not end
    hub_faults.reset()
    with open_store(url, endpoint=hub.endpoint, token=hub.write_token, token_env="", prestart=False) as store:
        left = len(list(store.list("p/")))
    if "; 1,000 more were being removed and may be gone too;" in last:  # stopped inside the delete
        assert left in (0, N_OBJECTS - 1_000), left  # the batch under way went, or did not
    else:  # stopped while listing the next batch
        assert left == N_OBJECTS - 1_000, left
