"""Issue 38's redeploy table: a model directory changed in place, its identity computed before
and after, each in a fresh process sharing the machine's digest cache (as restarts do).

Every change the KV depends on gives a new identity (a miss): a fine-tune of one tensor anywhere
in a file, a merged LoRA, a replaced shard, weights in a subfolder, every config field of other
model families and of a nested ``text_config``, an unknown field, the KV dtype, quantization.
Changes it does not depend on keep it (a hit): a copy elsewhere, a ``touch``, ignored keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvbucket.testing.redeploys import CHANGES, KV, SAME, Case, prepare

# Prints {path: token} for each (path, kv) given as JSON on stdin: one fresh interpreter.
SCRIPT = """
import json, sys
from kvbucket.identity.core import identity_of_dir
print(json.dumps({p: identity_of_dir(p, "org/m", kv=kv).token for p, kv in json.load(sys.stdin)}))
"""


def tokens_in_fresh_process(items: list[tuple[Path, dict[str, Any]]], cache: Path) -> dict[str, str]:
    env = {**os.environ, "KVBUCKET_IDENTITY_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps([(str(p), kv) for p, kv in items]),
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout)


def run_table(root: Path, cases: tuple[Case, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """(before, after) token of each case: before, all in one fresh process (which fills the
    digest cache: a change must not hide behind it); then each change made in place and its
    identity in its own fresh process."""
    dirs = prepare(root / "models", cases)
    cache = root / "identity-cache.json"
    time.sleep(1.1)  # the copies are older than RACY_NS: the first process keeps their digests
    base = tokens_in_fresh_process([(dirs[c.name], KV)
                                    for c in cases], cache)
    before = {c.name: base[str(dirs[c.name])] for c in cases}
    assert len(json.loads(cache.read_text())["files"]) >= len(cases)  # every copy's files kept
    for c in cases:
        if c.change is not None:
            c.change(dirs[c.name])

    def after(c: Case) -> str:
        return tokens_in_fresh_process([(dirs[c.name], c.kv)], cache)[str(dirs[c.name])]

    with ThreadPoolExecutor(2) as ex:
        after_list = list(ex.map(after, cases))
    return before, dict(zip([c.name for c in cases], after_list, strict=True))


@pytest.mark.slow(4)
def test_every_redeploy_in_place_is_a_new_identity(tmp_path: Path) -> None:
    assert len(CHANGES) >= 40
    before, after = run_table(tmp_path, CHANGES)
    # before any change, each base's copies (at other paths) share one identity
    assert len({before[c.name] for c in CHANGES if c.base == "small"}) == 1
    assert len({before[c.name] for c in CHANGES if c.base == "big"}) == 1
    kept = [name for name in after if after[name] == before[name]]
    assert kept == [], f"{len(kept)} of {len(CHANGES)} redeploys kept the old identity: {kept}"
    # and no two redeploys share one
    by_token: dict[str, list[str]] = {}
    for name, tok in after.items():
        by_token.setdefault(tok, []).append(name)
    assert [names for names in by_token.values() if len(names) > 1] == []


def test_what_cannot_change_the_kv_keeps_the_identity(tmp_path: Path) -> None:
    before, after = run_table(tmp_path, SAME)
    changed = [name for name in after if after[name] != before[name]]
    assert changed == [], f"these kept the KV but changed the identity (a needless miss): {changed}"
