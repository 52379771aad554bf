"""`kvbucket demo` as a user runs it, at 0 ms and with 50 ms added to every request: the README's demo line.

    PYTHONPATH=src python benchmarks/bench_demo.py [--latencies-ms 0,50] [--rounds 1]

Each run is the installed console script (``kvbucket demo``, next to this Python, running this
checkout's ``src``), with ``--latency-ms`` when the latency is not 0: machine A stores a
4,096-token prompt's KV in a private bucket on the in-process Hub emulator, machine B (a fresh
process, empty local tiers) answers the same document through the cache, then recomputes it
with a plain ``generate`` (the demo's own peer, measured in the same run). The figures are read
from the table the demo prints; a run whose outputs differ (exit 1) or that cannot run fails
the benchmark. Latencies alternate their order by round.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
SRC = str(BENCH.parent / "src")
sys.path.insert(0, str(BENCH))
from results import Results, add_argument  # noqa: E402

#: The rows of the demo's table this reads (kvbucket/demo/real_model.py, ``_print_table``).
ROWS = {
    "ttft_ref_s": r"TTFT without cache\s*\S\s*([\d.]+) s",
    "ttft_hit_s": r"TTFT with cache \(cross-machine hit[^)]*\)\s*\S\s*([\d.]+) s",
    "delayed_requests": r"on each of ([\d,]+) requests",
    "hit_tokens": r"hit tokens\s*\S\s*([\d,]+) of",
    "prompt_tokens": r"prompt \(document \+ question\)\s*\S\s*([\d,]+) tokens",
    "identical": r"outputs identical\s*\S\s*(\w+)",
}


def parse(text: str) -> dict[str, Any]:
    """The figures of one demo run's table; a row missing from it (the demo changed) is an error."""
    out: dict[str, Any] = {}
    for key, pattern in ROWS.items():
        m = re.search(pattern, text)
        if m is None:
            if key == "delayed_requests":  # printed only with --latency-ms
                out[key] = 0
                continue
            raise ValueError(f"kvbucket demo printed no {key!r} row; its output:\n{text[-3000:]}")
        value = m.group(1).replace(",", "")
        out[key] = value == "yes" if key == "identical" else float(value) if "." in value else int(value)
    return out


def kvbucket_command() -> list[str]:
    """The console script a user runs: the one installed next to this Python, else on PATH."""
    script = Path(sys.executable).parent / "kvbucket"
    if script.exists():
        return [str(script)]
    found = shutil.which("kvbucket")
    if found is None:
        raise SystemExit("no `kvbucket` console script next to this Python or on PATH: pip install -e .")
    return [found]


def run_demo(latency_ms: float) -> dict[str, Any]:
    """One `kvbucket demo` run (defaults, plus ``--latency-ms`` unless 0) and the figures it printed."""
    cmd = [*kvbucket_command(), "demo"] + (["--latency-ms", f"{latency_ms:g}"] if latency_ms else [])
    env = dict(os.environ, PYTHONPATH=SRC, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"kvbucket {' '.join(cmd[1:])} exited {proc.returncode}:\n{tail}")
    return {**parse(proc.stdout), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latencies-ms", default="0,50",
                   help="comma-separated; 0 runs the demo without --latency-ms")
    p.add_argument("--rounds", type=int, default=1, help="demo runs per latency")
    add_argument(p)
    args = p.parse_args()
    latencies = [float(x) for x in args.latencies_ms.split(",") if x.strip()]
    res = Results("bench_demo", params=vars(args),
                  title="`kvbucket demo`: a cross-machine hit's time to first token at 0 and 50 ms",
                  notes="the installed `kvbucket demo` (a Qwen2.5-0.5B-shaped Llama with random weights, "
                        "float32, 4,096-token document) on the in-process Hub emulator; the peer is the "
                        "demo's own plain `generate` on machine B, in the same run")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    got: dict[float, list[dict[str, Any]]] = {ms: [] for ms in latencies}
    for r in range(args.rounds):
        for ms in latencies if r % 2 == 0 else latencies[::-1]:
            out = run_demo(ms)
            got[ms].append(out)
            res.run(latency_ms=ms, round=r + 1, **out)
            print(f"latency {ms:g} ms, round {r + 1}: TTFT hit {out['ttft_hit_s']:.2f} s, recompute "
                  f"{out['ttft_ref_s']:.2f} s, {out['delayed_requests']} requests delayed, "
                  f"{out['wall_s']:.0f} s wall", flush=True)
    for ms, outs in got.items():
        hit = statistics.median(o["ttft_hit_s"] for o in outs)
        ref = statistics.median(o["ttft_ref_s"] for o in outs)
        delayed = statistics.median(o["delayed_requests"] for o in outs)
        res.compare(f"hit {ms:g} ms", f"demo: TTFT, cross-machine hit, {ms:g} ms per request",
                    ours=hit, peer=ref, peer_name="recompute (plain generate)", unit="s",
                    higher_is_better=False, ratios=[o["ttft_ref_s"] / o["ttft_hit_s"] for o in outs],
                    latency_ms=ms, delayed_requests=delayed)
    print(f"load average at end: {os.getloadavg()}")
    res.write(args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
