"""bench_ceiling runs end to end (tiny: ``--quick``) and writes the figures docs/benchmarks.md shows.

Only fields and verification are checked here, never timings: the figures themselves are the
benchmark's (docs/benchmarks.md, rendered from benchmarks/results/bench_ceiling*.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render  # noqa: E402


@pytest.mark.slow(55)
def test_a_quick_run_writes_cpu_gil_and_ceiling_per_path_payload_phase_and_op(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ceiling.py"), "--quick",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_ceiling.json").read_text())
    runs = data["runs"]
    assert runs and all(r["verified"] for r in runs), [r for r in runs if not r["verified"]]
    cells = {(r["side"], r["op"], r["payload"], r["phase"]) for r in runs}
    kvbucket = ("kvbucket-s3", "kvbucket-s3@sendfile", "kvbucket-hub")
    for side in (*kvbucket, "obstore", "boto3", "lmcache-s3", "hf_xet-stream", "download_bucket_files",
                 "lmcache-hfbucket"):  # --quick: the random row on kvbucket's sides only
        for payload in ("kv", "random") if side in kvbucket else ("kv",):
            assert {(side, "load", payload, "cold"), (side, "load", payload, "warm")} <= cells
    assert not {c for c in cells if c[2] == "random" and c[0] not in kvbucket}, cells
    for side in ("kvbucket-s3", "kvbucket-hub", "lmcache-s3", "lmcache-hfbucket"):  # the sides that store
        assert (side, "store", "kv", "cold") in cells
    assert {("kvbucket-s3", "store", "random", "warm"), ("kvbucket-hub", "store", "random", "cold")} <= cells
    for r in runs:
        assert r["size_mib"] == 2 and r["cpu_s_per_gib"] > 0 and r["gibs"] > 0
        assert "gil_s_per_gib" in r and "ceiling_gibs" in r
        if r["gil_s_per_gib"]:
            assert abs(r["ceiling_gibs"] * r["gil_s_per_gib"] - 1) < 1e-3
        # who did the work: this process's threads (shares of their CPU), the server's and the box's cores
        assert r["threads"] and r["busy_threads"] == len(r["threads"]), r
        shares = [t["share"] for t in r["threads"]]  # threads of >= 2% of the phase's thread CPU
        assert min(shares) >= 0.019 and sum(shares) <= 1.01 and r["runq_wait_s"] >= 0, r["threads"]
        assert r["server_cores"] is not None and r["server_cores"] >= 0
        # the box's cores come from /proc/stat's ticks: a phase shorter than one reads None, not 0
        assert r["box_cpus"] >= 1
        assert r["box_cores"] is None or 0 <= r["box_cores"] <= r["box_cpus"] + 0.01, r
        if r["wall_s"] >= 0.2:
            assert r["box_cores"] is not None, r
    s3_load = [r for r in runs if r["side"].startswith("kvbucket-s3") and r["op"] == "load"]
    assert all(r["threads"][0]["name"] == "main" for r in s3_load), s3_load  # get_many runs on the caller's
    fig = data["figures"]["s3 kvbucket-s3 load kv 2 MiB warm"]
    assert {"cpu_s_per_gib", "gil_s_per_gib", "ceiling_gibs", "rounds", "verified"} <= set(fig)
    page = "\n".join(render.section("bench_ceiling", data))
    assert "| kvbucket-s3 (s3) | load | kv | warm |" in page and "GIL-held s/GiB (2 MiB)" in page
    assert "| lmcache-s3 (s3) | store | kv | cold |" in page
    assert "| lmcache-hfbucket (hub) | load | kv | warm |" in page
    assert "cores: client + server (2 MiB)" in page


def test_the_box_meter_counts_a_busy_core_and_says_none_for_an_interval_it_cannot_see() -> None:
    import time

    import ceiling_meters

    with ceiling_meters.CpuMeter() as spin:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
    assert spin.result["box_cpus"] >= 1
    assert 0.5 <= spin.result["box_cores"] <= spin.result["box_cpus"] + 0.01, spin.result
    same = ceiling_meters.box_busy()
    assert ceiling_meters.box_cores(same, same) is None  # no tick passed: unmeasured, not idle
    assert ceiling_meters.box_cores((0.0, 0.0, 0), (0.0, 0.0, 0)) is None  # no /proc/stat
