"""benchmarks/bench_demo.py reads the figures of the README's demo line from the table `kvbucket demo`
prints: here that table is printed by the demo's own code (no model run), so a changed row fails
here rather than in the next benchmark run."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvbucket.demo.real_model import DemoConfig, _print_table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_demo  # noqa: E402
import render  # noqa: E402


def printed(latency_ms: float | None, identical: bool = True) -> str:
    """The table of one demo run, as the demo prints it (rich, no colour, a wide terminal)."""
    tiers = [{"kind": "tier", "name": "remote", "bytes_read": 100663296, "bytes_written": 0}]
    a = {"chunks_stored": 16, "chunk_bytes": 6291456, "chunks_failed": 0, "tiers": tiers,
         "integrity_verified": 16, "integrity_failures": 0}
    b: dict[str, Any] = {"prompt_tokens": 4128, "ttft_ref": 47.56, "ttft_hit": 0.52, "hit_tokens": 4096,
                         "computed_tokens": 32, "bytes_loaded": 100663296, "load_seconds": 0.31,
                         "tiers": tiers, "first_logit_max_diff": 8.46e-06, "identical": identical,
                         "output_with": "x", "output_without": "y"}
    if latency_ms is not None:
        b.update(latency_ms=latency_ms, delayed_requests=34)
    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True)
    _print_table(console, DemoConfig(), a, b, 63.0)
    return out.getvalue()


@pytest.mark.parametrize("latency_ms", [None, 50.0])
def test_the_figures_are_read_from_the_demos_table(latency_ms: float | None) -> None:
    got = bench_demo.parse(printed(latency_ms))
    assert got == {"ttft_ref_s": 47.56, "ttft_hit_s": 0.52, "delayed_requests": 34 if latency_ms else 0,
                   "hit_tokens": 4096, "prompt_tokens": 4128, "identical": True}
    assert bench_demo.parse(printed(latency_ms, identical=False))["identical"] is False


def test_a_row_the_demo_no_longer_prints_is_an_error() -> None:
    text = printed(50.0).replace("TTFT without cache", "TTFT, recompute")
    with pytest.raises(ValueError, match="ttft_ref_s"):
        bench_demo.parse(text)


def test_the_readme_demo_line_gives_each_latency_next_to_the_recompute() -> None:
    def comp(ms: float, hit: float, ref: float) -> dict[str, Any]:
        return {"ours": hit, "peer": ref, "ratio": ref / hit, "latency_ms": ms,
                "delayed_requests": 34 if ms else 0}

    results = {"bench_demo": {"date": "2026-11-27T05:00:00Z", "machine": {"cores": 2},
                              "load_average": {"start": [1.5, 1, 1]},
                              "comparisons": {"hit 50 ms": comp(50, 0.52, 47.0),
                                              "hit 0 ms": comp(0, 0.4, 46.0)}}}
    line = render.demo_line(results)
    assert "**0.400 s** at 0 ms" in line and "**0.520 s** with 50 ms added to each of 34 requests" in line
    assert line.index("0 ms (loopback)") < line.index("50 ms added")
    assert "46.0 s and 47.0 s recomputing" in line and "docs/benchmarks.md#bench_demo" in line
    assert "not been run" in render.demo_line({})
