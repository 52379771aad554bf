"""Render benchmarks/results/*.json into docs/benchmarks.md, docs/img/*.svg and the README's table.

    python benchmarks/render.py            # needs matplotlib: pip install -c constraints.txt -e '.[docs]'

Nothing here measures anything: every figure comes from a results file a benchmark wrote
(benchmarks/results.py), with its machine, load, command, date and commit. Generated files are
overwritten whole; the README only between its ``<!-- benchmarks:headline -->`` markers (the
headline table) and its ``<!-- benchmarks:demo -->`` markers (the demo line, bench_demo.json).
tests/docs/test_benchmarks_render.py renders again into a temporary directory and fails when a
committed page, chart or table differs from what the results files give.

SVGs are deterministic (a fixed ``svg.hashsalt``, no date) and carry the data they were drawn
from as JSON in their ``<dc:description>``, so the test can compare the data a chart shows
without depending on pixel output.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS_DIR, load_all

ROOT = Path(__file__).resolve().parents[1]
PAGE = Path("docs/benchmarks.md")
IMG = Path("docs/img")
README = Path("README.md")
START, END = "<!-- benchmarks:headline:start -->", "<!-- benchmarks:headline:end -->"
DEMO_START, DEMO_END = "<!-- benchmarks:demo:start -->", "<!-- benchmarks:demo:end -->"
DATA_RE = re.compile(r"<dc:description>(.*?)</dc:description>", re.S)

#: The README's headline rows, in order of priority: results file, comparison key(s), what the
#: row says. A row of two keys shows both figures side by side (``0 / 50 ms``): the same measure
#: on loopback and at wide-area latency. The first 8 present are shown; a row whose file or keys
#: are all missing (a benchmark not run yet) is left out, one with a key missing shows the other.
HEADLINE: list[tuple[str, tuple[str, ...], str]] = [
    ("bench_transformers", ("hit hub 0 ms", "hit hub 50 ms"),
     "TTFT, cross-machine hit, 0 / 50 ms per request"),
    ("bench_latency-hub", ("hub-64x2-0ms-lmcache-hfbucket", "hub-64x2-50ms-lmcache-hfbucket"),
     "HF bucket lookup + load, 64 x 2 MiB, 0 / 50 ms"),
    ("bench_latency-hub", ("hub-64x2-0ms-download_bucket_files", "hub-64x2-50ms-download_bucket_files"),
     "HF bucket lookup + load, 64 x 2 MiB, 0 / 50 ms"),
    ("bench_latency-s3", ("s3-64x2-0ms-lmcache-s3", "s3-64x2-50ms-lmcache-s3"),
     "S3 lookup + load, 64 x 2 MiB, 0 / 50 ms"),
    ("bench_latency-s3", ("s3-64x2-0ms-boto3", "s3-64x2-50ms-boto3"),
     "S3 lookup + load, 64 x 2 MiB, 0 / 50 ms"),
    ("bench_l2", ("hfbucket lookup+load",), "HF bucket lookup + load in LMCache's own bench runner, 0 ms"),
    ("bench_l2", ("hfbucket store",), "HF bucket store in LMCache's own bench runner, 0 ms"),
    ("bench_local", ("LocalDiskBackend get",), "local disk tier get"),
    ("bench_hfbucket", ("lookup + load",), "HF bucket lookup + load, loopback"),
    ("bench_s3", ("load vs lmcache",), "S3 load, loopback"),
]
MAX_HEADLINE = 8

#: Order of the sections on the page (others follow, by name).
ORDER = ["bench_demo", "bench_transformers", "bench_latency-hub", "bench_latency-s3", "bench_latency",
         "bench_hfbucket", "bench_s3", "bench_l2", "bench_local"]


def fmt(v: Any) -> str:
    """A figure as a reader wants it: 3 significant digits, thousands separated."""
    if v is None:
        return "-"
    if isinstance(v, list) and v and all(isinstance(t, dict) and {"name", "share"} <= set(t) for t in v):
        return ", ".join(f"{t['name']} {t['share']:.0%}" for t in v[:4])  # bench_ceiling's threads
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2g}"


def ratio_text(c: dict[str, Any]) -> str:
    r = c.get("ratio")
    if r is None:
        return "-"
    rng = c.get("ratio_range")
    text = f"{r:.2f}x"
    if rng and len(c.get("ratios", [])) > 1:
        text += f" ({rng[0]:.2f}-{rng[1]:.2f})"
    return text


def _order(results: dict[str, dict[str, Any]]) -> list[str]:
    def key(name: str) -> tuple[int, str]:
        bench = results[name]["bench"]
        return (ORDER.index(bench) if bench in ORDER else len(ORDER), name)
    return sorted(results, key=key)


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _when(r: dict[str, Any]) -> str:
    load = r.get("load_average", {})
    start, end = load.get("start") or [None], load.get("end") or [None]
    m = r.get("machine", {})
    commit = (r.get("git", {}).get("commit") or "")[:10]
    dirty = " (uncommitted changes)" if r.get("git", {}).get("dirty") else ""
    return (f"{r['date'][:16].replace('T', ' ')} UTC, commit `{commit}`{dirty}; {m.get('cores')} cores "
            f"({m.get('cpu_model')}), load average {fmt(start[0])} at the start, {fmt(end[0])} at the end; "
            f"{fmt(r.get('duration_s'))} s")


def page(results: dict[str, dict[str, Any]]) -> str:
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/render.py` from benchmarks/results/*.json: do not edit. -->",
        "",
        "Every figure below was written by the benchmark script that measured it "
        "(`benchmarks/results/<name>.json`: machine, load average, command line, date, commit, "
        "per-round figures) and rendered by `python benchmarks/render.py`. Each figure stands next to "
        "its peer measured in the same run; the ratio says how many times better kvbucket's figure is "
        "(> 1: kvbucket ahead), with the range of the per-round ratios in brackets. The machine is "
        "small and shared (its load average is given per run), and servers run on the same cores, so "
        "absolute figures swing more than ratios. Earlier, hand-recorded figures are in "
        "[benchmarks-history.md](benchmarks-history.md), with their dates.",
        "",
    ]
    for name in _order(results):
        r = results[name]
        out.append(f"- [{r.get('title') or name}](#{name})")
    out.append("")
    for name in _order(results):
        out += section(name, results[name])
    return "\n".join(out).rstrip() + "\n"


def section(name: str, r: dict[str, Any]) -> list[str]:
    out = [f'<a id="{name}"></a>', "", f"## {r.get('title') or name}", "",
           f"`{name}.json`: {_when(r)}.", "", "```bash", r["command"], "```", ""]
    if r.get("notes"):
        out += [r["notes"], ""]
    comps = r.get("comparisons", {})
    if comps:
        if _has_chart(r):
            out += [f"![{name}](img/{name}.svg)", ""]
        goals = any(c.get("goal") for c in comps.values())  # a goal column only where one is set
        out += [_row(["what", "kvbucket", "peer", "ratio (per-round range)", *(["goal"] if goals else [])]),
                _row(["---"] * (4 + goals))]
        for c in comps.values():
            unit = c.get("unit", "")
            ours = f"{fmt(c.get('ours'))} {unit}".strip()
            if c.get("ours_name") not in (None, "kvbucket"):
                ours += f" ({c['ours_name']})"
            peer = f"{fmt(c.get('peer'))} {unit} ({c.get('peer_name')})"
            out.append(_row([c.get("label"), ours, peer, ratio_text(c),
                             *([c.get("goal") or ""] if goals else [])]))
        out.append("")
    figs = r.get("figures", {})
    if figs and r.get("bench") == "bench_ceiling":
        out += ceiling_table(figs)
    elif figs:
        goals = any(f.get("goal") for f in figs.values())
        out += [_row(["figure", "value", *(["goal"] if goals else [])]), _row(["---"] * (2 + goals))]
        out += [_row([f.get("label"), f"{fmt(f.get('value'))} {f.get('unit', '')}".strip(),
                      *([f.get("goal") or ""] if goals else [])]) for f in figs.values()]
        out.append("")
    params = r.get("params", {})
    if params:
        out.append("Settings: " + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in params.items()) + ".")
        out.append("")
    runs = r.get("runs", [])
    if runs:
        cols: list[str] = []
        for row in runs:
            cols += [k for k in row if k not in cols]
        out += [f"<details><summary>per-run figures ({len(runs)} rows)</summary>", "",
                _row(cols), _row(["---"] * len(cols))]
        out += [_row([fmt(row.get(k)) for k in cols]) for row in runs]
        out += ["", "</details>", ""]
    return out


def ceiling_table(figs: dict[str, Any]) -> list[str]:
    """bench_ceiling's figures as one row per path, operation, payload and phase, the sizes side
    by side (``2 / 8 / 32``): client CPU, GIL-held and the projected ceiling (1 / GIL-held)."""
    rows: dict[tuple[str, ...], dict[int, dict[str, Any]]] = {}
    for f in figs.values():
        key = (f.get("backend"), f.get("side"), f.get("op"), f.get("payload"), f.get("phase"))
        rows.setdefault(key, {})[f.get("size_mib")] = f
    sizes = sorted({s for cells in rows.values() for s in cells})
    label = " / ".join(f"{s}" for s in sizes)
    out = [_row(["path", "op", "payload", "phase", f"GiB/s ({label} MiB)", f"client CPU s/GiB ({label} MiB)",
                 f"GIL-held s/GiB ({label} MiB)", f"projected ceiling GiB/s ({label} MiB)",
                 f"cores: client + server ({label} MiB)"]),
           _row(["---"] * 9)]
    for (backend, side, op, payload, phase), cells in rows.items():
        def col(k: str, cells: dict[int, dict[str, Any]] = cells) -> str:
            return " / ".join(fmt(cells[s].get(k)) if s in cells else "-" for s in sizes)

        def cores(c: dict[str, Any] | None) -> str:
            return "-" if c is None else f"{fmt(c.get('cores'))} + {fmt(c.get('server_cores'))}"
        ok = all(c.get("verified", True) for c in cells.values())
        out.append(_row([f"{side} ({backend})", op, payload, phase if ok else f"{phase} (WRONG BYTES)",
                         col("gibs"), col("cpu_s_per_gib"), col("gil_s_per_gib"), col("ceiling_gibs"),
                         " / ".join(cores(cells.get(s)) for s in sizes)]))
    out.append("")
    return out


def headline(results: dict[str, dict[str, Any]]) -> str:
    rows = [_row(["measure (link: full table)", "kvbucket", "peer, same run", "ratio"]), _row(["---"] * 4)]
    shown = 0
    for name, keys, what in HEADLINE:
        comps = [c for k in keys if (c := results.get(name, {}).get("comparisons", {}).get(k)) is not None]
        if not comps or shown == MAX_HEADLINE:
            continue
        shown += 1
        unit = comps[0].get("unit", "")
        date = results[name]["date"][:10]
        peers = [fmt(c.get("peer")) for c in comps]
        peer = peers[0] if len(set(peers)) == 1 else " / ".join(peers)
        ratios = " / ".join(f"{c['ratio']:.2f}x" if c.get("ratio") is not None else "-" for c in comps)
        rows.append(_row([f"[{what}](docs/benchmarks.md#{name}) ({date})",
                          " / ".join(f"{fmt(c.get('ours'))} {unit}".strip() for c in comps),
                          f"{peer} {unit} {comps[0].get('peer_name')}".strip(), f"**{ratios}**"]))
    return "\n".join(rows)


def demo_line(results: dict[str, dict[str, Any]]) -> str:
    """The README's demo line: `kvbucket demo`'s hit TTFT at each latency it was run with
    (bench_demo.json), next to the recompute of the same runs."""
    r = results.get("bench_demo") or {}
    comps = sorted(r.get("comparisons", {}).values(), key=lambda c: c.get("latency_ms") or 0)
    if not comps:
        return "(`python benchmarks/bench_demo.py` has not been run: no figures yet.)"
    hits = []
    for c in comps:
        ms = c.get("latency_ms") or 0
        at = (f"with {ms:g} ms added to each of {fmt(c.get('delayed_requests'))} requests" if ms
              else "at 0 ms (loopback)")
        hits.append(f"**{fmt(c['ours'])} s** {at}")
    refs = " and ".join(f"{fmt(c['peer'])} s" for c in comps)
    ratios = " and ".join(f"{c['ratio']:.1f}x" for c in comps if c.get("ratio"))
    load = r.get("load_average", {}).get("start") or [None]
    cores = r.get("machine", {}).get("cores")
    return (f"What `kvbucket demo` printed on a {cores}-core machine ([{r['date'][:10]}, load "
            f"{fmt(load[0])}](docs/benchmarks.md#bench_demo)): machine B's time to first token through "
            f"the cache (a cross-machine hit) {', '.join(hits)}, against {refs} recomputing the prompt "
            f"with a plain `generate` in the same runs ({ratios} faster).")


def splice(text: str, start: str, end: str, body: str) -> str:
    """``text`` with ``body`` between its ``start`` and ``end`` markers (which must be there)."""
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def splice_readme(text: str, table: str, demo: str | None = None) -> str:
    """README text with the headline table (and the demo line) between their markers."""
    text = splice(text, START, END, table)
    return text if demo is None else splice(text, DEMO_START, DEMO_END, demo)


# ---- charts ------------------------------------------------------------------------------------


def _has_chart(r: dict[str, Any]) -> bool:
    return any(c.get("ratio") is not None for c in r.get("comparisons", {}).values())


def chart_data(name: str, r: dict[str, Any]) -> dict[str, Any]:
    """What a results file's chart shows: one bar per comparison, its ratio (kvbucket / peer)."""
    bars = [{"label": c["label"], "peer": c.get("peer_name"), "ratio": round(c["ratio"], 4),
             "range": [round(x, 4) for x in c.get("ratio_range", [])]}
            for c in r.get("comparisons", {}).values() if c.get("ratio") is not None]
    return {"kind": "ratios", "name": name, "date": r["date"], "bars": bars}


def ttft_data(r: dict[str, Any]) -> dict[str, Any] | None:
    """The README's picture: TTFT of recompute against local and cross-machine hits."""
    comps = r.get("comparisons", {})
    if not comps:
        return None
    first = next(iter(comps.values()))
    bars = [{"label": "recompute (no cache)", "seconds": round(first["peer"], 4)}]
    names = {"hit local_cpu": "local hit (CPU tier)", "hit remote": "hit from another disk",
             "miss+store": "miss + store"}
    for key, c in comps.items():
        if key.startswith("hit hub"):
            label = f"cross-machine hit, {key.removeprefix('hit hub ')}"
        elif key in names:
            label = names[key]
        else:
            continue
        bars.append({"label": label, "seconds": round(c["ours"], 4)})
    prompt = r.get("figures", {}).get("prompt_tokens", {}).get("value")
    return {"kind": "ttft", "date": r["date"], "prompt_tokens": prompt,
            "layers": r.get("params", {}).get("layers"), "bars": bars}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "kvbucket", "svg.fonttype": "path", "font.size": 10,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def draw(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    bars = data["bars"]
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(bars) + 1.2))
    labels = [b["label"] if data["kind"] == "ttft" else f"{b['label']} vs {b['peer']}" for b in bars]
    ys = list(range(len(bars)))[::-1]
    if data["kind"] == "ttft":
        vals = [b["seconds"] for b in bars]
        colors = ["#9e9e9e"] + ["#1f77b4"] * (len(bars) - 1)
        ax.barh(ys, vals, color=colors)
        for y, v in zip(ys, vals, strict=True):
            ax.text(v, y, f" {v:.2f} s", va="center")
        ax.set_xlabel("time to first token, seconds (lower is better)")
        ax.set_title(f"Time to first token, {data['prompt_tokens']:,}-token prompt, {data['layers']}-layer "
                     f"model ({data['date'][:10]})", loc="left")
        ax.set_xlim(0, max(vals) * 1.2)
    else:
        vals = [b["ratio"] for b in bars]
        ax.barh(ys, vals, color=["#1f77b4" if v >= 1 else "#d62728" for v in vals])
        for y, b in zip(ys, bars, strict=True):
            if len(b["range"]) == 2:
                ax.plot(b["range"], [y, y], color="black", linewidth=1)
            ax.text(max(b["ratio"], *(b["range"] or [0])), y, f" {b['ratio']:.2f}x", va="center")
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlabel("kvbucket / peer, same run (> 1: kvbucket ahead)")
        ax.set_title(f"{data['name']} ({data['date'][:10]})", loc="left")
        ax.set_xlim(0, max(max(vals), *(x for b in bars for x in b["range"] or [0])) * 1.2)
    ax.set_yticks(ys, labels)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    desc = json.dumps(data, sort_keys=True)
    if path.suffix == ".svg":
        fig.savefig(path, format="svg", bbox_inches="tight",  # the left-aligned title may pass the axes
                    metadata={"Date": None, "Description": desc})
    else:  # a preview (.png)
        fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def svg_data(path: Path) -> dict[str, Any]:
    """The data a chart was drawn from (see :func:`draw`)."""
    m = DATA_RE.search(path.read_text(encoding="utf-8"))
    if m is None:
        raise ValueError(f"{path}: no data in the SVG's description")
    return json.loads(html.unescape(m.group(1)))


def charts(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every chart to draw: file name under docs/img -> its data."""
    out = {f"{n}.svg": chart_data(n, r) for n, r in results.items() if _has_chart(r)}
    tf = results.get("bench_transformers")
    ttft = ttft_data(tf) if tf else None
    if ttft:
        out["ttft.svg"] = ttft
    return out


def render(results_dir: Path = RESULTS_DIR, out_root: Path = ROOT,
           readme_in: Path | None = None) -> list[Path]:
    """Write the page, the charts and the README (read from ``readme_in``, default the output's);
    returns the files written."""
    results = load_all(results_dir)
    written = []
    (out_root / PAGE).parent.mkdir(parents=True, exist_ok=True)
    (out_root / PAGE).write_text(page(results), encoding="utf-8")
    written.append(out_root / PAGE)
    drawn = charts(results)
    for fname, data in drawn.items():
        draw(data, out_root / IMG / fname)
        written.append(out_root / IMG / fname)
    for old in (out_root / IMG).glob("*.svg"):  # a chart whose results file is gone
        if old.name not in drawn and DATA_RE.search(old.read_text(encoding="utf-8")):
            old.unlink()
    src = (readme_in or out_root / README).read_text(encoding="utf-8")
    readme = splice_readme(src, headline(results), demo_line(results))
    (out_root / README).write_text(readme, encoding="utf-8")
    written.append(out_root / README)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results directory")
    args = ap.parse_args(argv)
    for p in render(args.results):
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
