"""docs/benchmarks.md, docs/img/*.svg and the README's headline table are what the results give.

They are rendered from benchmarks/results/*.json by ``python benchmarks/render.py``; here the
renderer runs again into a temporary directory and every committed output is compared with it.
A figure typed by hand into one of them, or a results file changed without re-rendering, fails.
Charts are compared by the data they were drawn from (kept in each SVG), and byte for byte
when the installed matplotlib is the pinned one.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render  # noqa: E402
import results  # noqa: E402


def differences(results_dir: Path, root: Path, tmp: Path) -> list[str]:
    """What in ``root`` (README, docs/benchmarks.md, docs/img) differs from a fresh rendering."""
    out = tmp / "rendered"
    shutil.rmtree(out, ignore_errors=True)
    render.render(results_dir, out, readme_in=root / render.README)
    diffs = []
    for rel in (render.PAGE, render.README):
        if (root / rel).read_text(encoding="utf-8") != (out / rel).read_text(encoding="utf-8"):
            diffs.append(f"{rel} differs from `python benchmarks/render.py`'s output")
    ours = {p.name for p in (root / render.IMG).glob("*.svg") if render.DATA_RE.search(p.read_text())}
    fresh = {p.name for p in (out / render.IMG).glob("*.svg")}
    if ours != fresh:
        diffs.append(f"charts: committed {sorted(ours)}, rendered {sorted(fresh)}")
    pinned = _pinned("matplotlib")
    for name in sorted(ours & fresh):
        a, b = root / render.IMG / name, out / render.IMG / name
        if render.svg_data(a) != render.svg_data(b):
            diffs.append(f"{render.IMG / name}: drawn from other data than the results give")
        elif matplotlib.__version__ == pinned and a.read_bytes() != b.read_bytes():
            diffs.append(f"{render.IMG / name}: same data, different drawing (re-render)")
    return diffs


def _pinned(pkg: str) -> str | None:
    m = re.search(rf"^{pkg}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    return m.group(1) if m else None


def test_committed_pages_charts_and_readme_match_the_results(tmp_path: Path) -> None:
    assert list(results.RESULTS_DIR.glob("*.json")), "no committed results in benchmarks/results"
    diffs = differences(results.RESULTS_DIR, ROOT, tmp_path)
    assert not diffs, "\n".join(diffs) + "\nrun: python benchmarks/render.py"


def test_the_readme_headline_is_short_and_linked() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split(render.START, 1)[1].split(render.END, 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("|")][2:]
    assert 1 <= len(rows) <= render.MAX_HEADLINE == 8
    assert all("docs/benchmarks.md#" in r for r in rows)


@pytest.mark.parametrize("where", ["results", "page", "readme", "demo", "chart"])
def test_a_hand_edit_or_a_changed_result_is_caught(tmp_path: Path, where: str) -> None:
    """The comparison above is not vacuous: each kind of drift is reported."""
    res, root = tmp_path / "results", tmp_path / "root"
    res.mkdir()
    # two small results files with comparisons are enough (every chart costs a matplotlib drawing)
    compared = [p for p in results.RESULTS_DIR.glob("*.json") if json.loads(p.read_text())["comparisons"]]
    files = sorted(compared, key=lambda p: p.stat().st_size)[:2]
    for p in files:
        shutil.copy(p, res / p.name)
    (root / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    render.render(res, root)
    assert differences(res, root, tmp_path) == []
    if where == "results":  # a benchmark re-run without re-rendering
        path = next(p for p in sorted(res.glob("*.json")) if json.loads(p.read_text())["comparisons"])
        data = json.loads(path.read_text())
        c = next(iter(data["comparisons"].values()))
        c["ratio"] = (c["ratio"] or 1) * 1.37
        path.write_text(json.dumps(data))
    elif where == "page":
        page = root / render.PAGE
        page.write_text(page.read_text().replace("x", "y", 1))
    elif where == "readme":  # a hand-typed row in the headline table
        readme = root / render.README
        row = "| [TTFT](docs/benchmarks.md#bench_x) (2026-11-27) | 0.1 s | 9 s recompute | **90.00x** |\n"
        readme.write_text(readme.read_text().replace(render.END, row + render.END, 1))
    elif where == "demo":  # a hand-typed figure in the demo line
        readme = root / render.README
        hand = "(0.1 s at 50 ms)\n"
        readme.write_text(readme.read_text().replace(render.DEMO_END, hand + render.DEMO_END, 1))
    else:
        svg = next((root / render.IMG).glob("*.svg"))
        svg.write_text(re.sub(r'("ratio"|&quot;ratio&quot;|"seconds"|&quot;seconds&quot;): [\d.]+',
                              r"\1: 9.99", svg.read_text(), count=1))
    assert differences(res, root, tmp_path)


def test_results_record_machine_load_command_and_commit(tmp_path: Path) -> None:
    """What a results file holds, written by the module every benchmark uses."""
    r = results.Results("bench_x", params={"chunks": 4, "results_dir": "x"},
                        argv=[str(results.BENCH_DIR / "bench_x.py"), "--chunks", "4",
                              "--results-dir", str(tmp_path)])
    r.run(round=1, wall_s=0.5)
    r.compare("load", "load", ours=200.0, peer=100.0, peer_name="peer", unit="MiB/s", ratios=[1.9, 2.1])
    r.compare("ttft", "ttft", ours=0.5, peer=2.0, peer_name="recompute", unit="s", higher_is_better=False)
    path = r.write(tmp_path)
    assert path == tmp_path / "bench_x.json"
    data = json.loads(path.read_text())
    assert data["command"] == "python benchmarks/bench_x.py --chunks 4"
    assert data["params"] == {"chunks": 4}
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu_model"]
    assert len(data["load_average"]["start"]) == 3
    assert data["git"]["commit"] and len(data["git"]["commit"]) == 40
    assert data["comparisons"]["load"]["ratio"] == 2.0
    assert data["comparisons"]["load"]["ratio_range"] == [1.9, 2.1]
    assert data["comparisons"]["ttft"]["ratio"] == 4.0
    assert data["runs"] == [{"round": 1, "wall_s": 0.5}]
    assert results.Results("bench_x").write("") is None  # '' writes nothing
