"""bench_l2's goal column: a goal only on the rows issues 23 and 30 set one for, at 0 ms in
LMCache's runner, Hub bucket, realistic KV or random payloads (issue 23, 64 x 2 MiB and 16 x 8 MiB:
store >= 1.0x, lookup + load >= 1.5x; issue 30, 64 x 2 MiB: store >= 1.1x, load with read-ahead off
>= 1.5x), in what it prints, in the results it writes and on the rendered page."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import l2_report  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402

OP_OF_KEY = {key: op for op, _who, key, _what in l2_report.COMPARED}


@pytest.mark.parametrize(("backend", "op", "shape", "random", "goal"), [
    ("hfbucket", "Store", (64, 2048), True, 1.1),  # issue 30
    ("hfbucket", "Store", (16, 8192), True, 1.0),  # issue 23
    ("hfbucket", "Lookup+Load", (64, 2048), True, 1.5),
    ("hfbucket", "Lookup+Load", (16, 8192), True, 1.5),
    ("hfbucket", "Lookup", (64, 2048), True, None),  # an index lookup: no goal
    ("hfbucket", "Load", (64, 2048), True, 1.5),  # issue 30: read-ahead off, LMCache's own runner
    ("hfbucket", "Load", (16, 8192), True, None),  # issue 30 sets it at 64 x 2 MiB only
    ("s3", "Store", (64, 2048), True, None),  # S3's goals are at 50 ms (bench_latency)
    ("s3", "Lookup+Load", (64, 2048), True, None),
    ("hfbucket", "Lookup+Load", (64, 2048), False, None),  # constant payloads: the dedup case
    ("hfbucket", "Store", (32, 256), True, None),  # a shape the issue sets nothing for
])
def test_goal_only_where_an_issue_sets_one(backend: str, op: str, shape: tuple[int, int], random: bool,
                                           goal: float | None) -> None:
    assert l2_report.goal_for(backend, op, *shape, random) == goal


def _side(ops: float) -> dict:
    return {"ops_per_sec_avg": ops}


def test_printed_table_marks_only_goal_rows() -> None:
    ops = ("Store", "Lookup+Load", "Lookup", "Load")
    base = {op: _side(100.0) for op in ops}
    mine = {"kvbucket": {"Store": _side(110.0), "Lookup+Load": _side(120.0)},
            l2_report.RA_OFF: {"Lookup": _side(50.0), "Load": _side(50.0)}}
    args = argparse.Namespace(num_keys=64, data_size_kb=2048, random_payloads=True)
    lines = l2_report.ratio_table([("hfbucket", base, mine), ("s3", base, mine)], args)
    rows = {(ln[:9].strip(), ln[10:44].strip()): ln for ln in lines[1:]}
    assert len(rows) == 8
    assert rows["hfbucket", "store"].endswith("1.10x  >=1.1x ok")
    assert rows["hfbucket", "lookup + load (read-ahead on)"].endswith("1.20x  >=1.5x MISSED")
    assert rows["hfbucket", "load (read-ahead off)"].endswith("0.50x  >=1.5x MISSED")
    goal_free = [ln for (backend, what), ln in rows.items() if backend == "s3" or "lookup (" in what]
    assert len(goal_free) == 5
    assert all(ln.endswith("x") and ">=" not in ln for ln in goal_free)  # ends at the ratio


def test_committed_bench_l2_results_carry_the_same_goals() -> None:
    files = sorted(results.RESULTS_DIR.glob("bench_l2*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        p = data["params"]
        for key, c in data["comparisons"].items():
            backend, _, what = key.partition(" ")
            goal = l2_report.goal_for(backend, OP_OF_KEY[what], p["num_keys"], p["data_size_kb"],
                                     p["random_payloads"])
            assert c["goal"] == (None if goal is None else f">= {goal}"), (path.name, key)


def test_rendered_page_shows_a_goal_column_only_where_a_goal_is_set() -> None:
    def compared(goal: str | None) -> dict:
        c = {"label": "x", "ours": 2.0, "peer": 1.0, "peer_name": "p", "unit": "s", "ratio": 2.0,
             "goal": goal}
        return {"date": "2026-11-27T00:00:00Z", "command": "python x.py", "comparisons": {"x": c}}

    def table_header(r: dict) -> str:
        return next(ln for ln in render.section("x", r) if ln.startswith("| what"))

    assert table_header(compared(None)) == "| what | kvbucket | peer | ratio (per-round range) |"
    assert table_header(compared(">= 1.5")).endswith("| goal |")
    assert "| >= 1.5 |" in render.section("x", compared(">= 1.5"))[-2]
