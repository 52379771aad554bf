"""docs/grafana/kvbucket.json imports into Grafana and queries only what kvbucket exports.

The exported series come from the Prometheus registry itself, after importing every kvbucket
module that defines metrics (found by their ``prometheus_client`` import), with each family's
type giving its series names (``_total`` for counters, ``_bucket``/``_sum``/``_count`` for
histograms). A panel that queries a renamed or misspelt metric, or groups by a label the
metric does not have, fails here rather than showing "No data" on an operator's screen.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "kvbucket.json"
SRC = ROOT / "src"
#: labels Prometheus adds at scrape time, or PromQL makes (histogram buckets)
SCRAPE_LABELS = {"job", "instance", "le"}
_PROMQL_WORDS = {"sum", "by", "rate", "increase", "max", "min", "avg", "histogram_quantile", "without",
                 "label_values", "count", "topk", "bottomk", "irate", "on", "ignoring", "group_left"}


def exported() -> dict[str, set[str]]:
    """Every series name kvbucket's registry can expose, with its label names."""
    pending = [".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
               for p in sorted((SRC / "kvbucket").rglob("*.py"))
               if "prometheus_client" in p.read_text(encoding="utf-8")]
    for _ in range(3):  # a module that fails first in this order may import once others have
        failed = []
        for mod in pending:
            try:
                importlib.import_module(mod)
            except ImportError:
                failed.append(mod)
        pending = failed
    assert not pending, f"cannot import {pending}"
    out: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    collectors = list(REGISTRY._collector_to_names)  # families even without samples
    for collector in collectors:
        describe = getattr(collector, "describe", None)
        families = list(describe() if describe else []) or list(collector.collect())
        for fam in families:
            if not fam.name.startswith("kvbucket_"):
                continue
            labels = set(getattr(collector, "_labelnames", ()) or ())  # Counter, Gauge, Histogram
            labels |= set(getattr(fam, "_labelnames", ()) or ())  # a custom collector's families
            labels |= {k for s in fam.samples for k in s.labels}
            for suffix in suffixes.get(fam.type, ("",)):
                out[fam.name + suffix] = labels
    return out


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_ranges = re.sub(r"\[[^\]]*\]", "", no_strings)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{|\[|\)|$|\s)", no_ranges))
    names |= set(re.findall(r"\b(kvbucket_[a-zA-Z0-9_]+)", no_ranges))
    label_lists = {w.strip() for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", no_ranges)
                   for w in grp.split(",")}
    return {n for n in names if n not in _PROMQL_WORDS and n not in label_lists and not n.isdigit()}


def used_labels(expr: str) -> set[str]:
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    by = {w.strip() for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", no_strings)
          for w in grp.split(",") if w.strip()}
    matchers = set(re.findall(r"[{,]\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", no_strings))
    return by | matchers


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    dash = dashboard()
    assert dash["title"] and dash["uid"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]


def test_every_query_names_a_metric_kvbucket_exports() -> None:
    known = exported()
    assert "kvbucket_store_bytes_total" in known and "kvbucket_store_latency_seconds_bucket" in known
    assert "kvbucket_fleet_bytes_used" in known and "kvbucket_integrity_failures_total" in known
    seen: set[str] = set()
    for title, expr in queries(dashboard()):
        names = metric_names(expr)
        assert names, f"{title}: no metric found in {expr!r}"
        unknown = sorted(n for n in names if n not in known)
        assert not unknown, f"panel {title!r} queries {unknown}, which kvbucket does not export"
        labels = set().union(*(known[n] for n in names)) | SCRAPE_LABELS
        bad = sorted(used_labels(expr) - labels)
        assert not bad, f"panel {title!r} uses labels {bad} that {sorted(names)} do not have"
        seen |= names
    # the areas the dashboard is for
    for family in ("kvbucket_backend_operations_total", "kvbucket_store_bytes_total",
                   "kvbucket_read_ahead_bytes_total", "kvbucket_store_latency_seconds_bucket",
                   "kvbucket_integrity_failures_total", "kvbucket_store_breaker_state",
                   "kvbucket_fleet_capacity_bytes", "kvbucket_l2_capacity_bytes",
                   "kvbucket_l2_evictions_total"):
        assert family in seen, f"no panel shows {family}"


@pytest.mark.parametrize(("expr", "why"), [
    ('sum(rate(kvbucket_store_byte_total{job=~"$job"}[5m]))', "does not export"),
    ("sum by (bucket) (rate(kvbucket_store_bytes_total[5m]))", "labels ['bucket']"),
    ("rate(kvbucket_store_latency_seconds[5m])", "does not export"),
])
def test_a_wrong_query_is_caught(expr: str, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dash = {"panels": [{"title": "bad", "targets": [{"expr": expr, "refId": "A"}]}]}
    monkeypatch.setattr(sys.modules[__name__], "dashboard", lambda: dash)
    with pytest.raises(AssertionError, match=re.escape(why)):
        test_every_query_names_a_metric_kvbucket_exports()
