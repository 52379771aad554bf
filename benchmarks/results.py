"""Benchmark results as data: every script writes one JSON file through :class:`Results`.

    from results import Results
    res = Results("bench_local", params=vars(args))          # notes the load average at the start
    res.run(case="LocalCPUBackend", round=1, put_gibs=3.1, get_gibs=2.8)     # per-run figures
    res.compare("get", "LocalCPUBackend get", ours=2.8, peer=2.6, peer_name="memcpy", unit="GiB/s",
                goal=">= 0.5")                                   # a figure and its peer, a ratio
    res.write()                                   # -> benchmarks/results/bench_local.json

Why one module: the figures in ``docs/benchmarks.md``, the charts in ``docs/img/`` and the
README's headline table are rendered from these files (``python benchmarks/render.py``), so a
figure is never typed by hand and always carries the machine, the load, the command and the
commit it was measured with. ``KVBUCKET_BENCH_RESULTS=DIR`` (or ``--results-dir``) writes
elsewhere (a scratch run that must not replace the committed results); ``--results-dir ''``
or ``KVBUCKET_BENCH_RESULTS=off`` writes nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEMA = 1
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
ENV_DIR = "KVBUCKET_BENCH_RESULTS"


def machine() -> dict[str, Any]:
    """What the figures depend on: cores, CPU model, memory, Python and OS."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model or platform.machine(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def git_commit() -> dict[str, Any]:
    """The commit the benchmark ran from, and whether the tree had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCH_DIR, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _clean(value: Any) -> Any:
    """JSON-safe: numpy scalars to floats, NaN/inf to None, tuples and paths to lists/strings."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_clean(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float) or hasattr(value, "__float__"):
        f = float(value)
        return None if math.isnan(f) or math.isinf(f) else round(f, 6)
    return str(value)


def results_dir(cli_value: str | None = None) -> Path | None:
    """Where results go: ``--results-dir``, else ``$KVBUCKET_BENCH_RESULTS``, else
    ``benchmarks/results``; ``None`` (write nothing) for an empty value or ``off``."""
    value = cli_value if cli_value is not None else os.environ.get(ENV_DIR)
    if value is None:
        return RESULTS_DIR
    if value.strip() in ("", "off", "0", "none"):
        return None
    return Path(value)


def add_argument(parser: Any) -> None:
    """``--results-dir`` on a script's argparse parser (see :func:`results_dir`)."""
    parser.add_argument("--results-dir", default=None,
                        help=f"where to write the JSON results (default benchmarks/results, or ${ENV_DIR}; "
                             "'' writes nothing)")


class Results:
    """The results of one benchmark invocation, written as ``<dir>/<name>.json``.

    ``name`` is the bench's name plus, for a setting that must not replace the default run's
    file, a variant (``bench_l2`` and ``bench_l2-random``).
    """

    def __init__(self, bench: str, *, variant: str | None = None, params: Mapping[str, Any] | None = None,
                 argv: Iterable[str] | None = None, title: str | None = None,
                 notes: str | None = None) -> None:
        self.bench = bench
        self.variant = variant
        self.title = title
        self.notes = notes
        self.params = {k: v for k, v in (params or {}).items() if k != "results_dir"}
        self.argv = list(sys.argv if argv is None else argv)
        self.started = _dt.datetime.now(_dt.UTC)
        self.load_start = _load()
        self.runs: list[dict[str, Any]] = []
        self.figures: dict[str, dict[str, Any]] = {}
        self.comparisons: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        return f"{self.bench}-{self.variant}" if self.variant else self.bench

    def run(self, **figures: Any) -> None:
        """One row of per-run figures (a round, a case, a repetition: whatever the script repeats)."""
        self.runs.append(dict(figures))

    def figure(self, key: str, value: float | None, unit: str = "", *, label: str | None = None,
               **extra: Any) -> None:
        """An absolute figure with no peer (a throughput, a request count, a wall time)."""
        self.figures[key] = {"label": label or key, "value": value, "unit": unit, **extra}

    def compare(self, key: str, label: str, *, ours: float | None, peer: float | None, peer_name: str,
                unit: str, higher_is_better: bool = True, ours_name: str = "kvbucket",
                goal: str | None = None, ratio: float | None = None,
                ratios: Iterable[float] | None = None, **extra: Any) -> None:
        """A figure next to its peer measured in the same run, and their ratio.

        ``ratio`` defaults to how many times better ``ours`` is (``ours / peer`` for a rate,
        ``peer / ours`` for a time); give it when the script computes a better one (the median
        of per-round ratios). ``ratios`` are the per-round ratios, kept for their range.
        """
        if ratio is None and ours and peer:
            ratio = ours / peer if higher_is_better else peer / ours
        entry: dict[str, Any] = {
            "label": label, "ours": ours, "ours_name": ours_name, "peer": peer, "peer_name": peer_name,
            "unit": unit, "higher_is_better": higher_is_better, "ratio": ratio, "goal": goal, **extra,
        }
        rs = [r for r in (ratios or ()) if r is not None]
        if rs:
            entry["ratios"] = list(rs)
            entry["ratio_range"] = [min(rs), max(rs)]
            entry.setdefault("ratio_median", statistics.median(rs))
        self.comparisons[key] = entry

    def as_dict(self) -> dict[str, Any]:
        return _clean({
            "schema": SCHEMA,
            "bench": self.bench,
            "variant": self.variant,
            "title": self.title,
            "notes": self.notes,
            "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "duration_s": (_dt.datetime.now(_dt.UTC) - self.started).total_seconds(),
            "command": _command(self.argv),
            "git": git_commit(),
            "machine": machine(),
            "load_average": {"start": self.load_start, "end": _load()},
            "params": self.params,
            "comparisons": self.comparisons,
            "figures": self.figures,
            "runs": self.runs,
        })

    def write(self, directory: str | Path | None = None) -> Path | None:
        """Write ``<directory>/<name>.json`` (see :func:`results_dir`); returns the path, or None."""
        where = results_dir(None if directory is None else str(directory))
        if where is None:
            return None
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(dumps(self.as_dict()), encoding="utf-8")
        os.replace(tmp, path)
        print(f"results: {_display(path)}", file=sys.stderr)
        return path


_SCALAR_LIST = re.compile(r"\[\s*([^\[\]{}]*?)\s*\]", re.S)


def dumps(data: Any) -> str:
    """Indented JSON with lists of scalars on one line (diffs stay readable)."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    return _SCALAR_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",\n")) + "]",
                            text) + "\n"


def _command(argv: list[str]) -> str:
    """The command line as a user would type it from the repo root."""
    if not argv:
        return ""
    argv = list(argv)
    for i, a in enumerate(argv):  # where the results went is not part of what was measured
        if a == "--results-dir":
            del argv[i : i + 2]
            break
        if a.startswith("--results-dir="):
            del argv[i]
            break
    script = Path(argv[0])
    try:
        shown = str(script.resolve().relative_to(BENCH_DIR.parent))
    except ValueError:
        shown = argv[0]
    return shlex.join(["python", shown, *argv[1:]])


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_all(directory: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every results file of a directory, by name (the file's stem)."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(directory.glob("*.json"))}
