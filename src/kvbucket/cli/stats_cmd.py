"""``kvbucket stats``: summarise a running process's Prometheus metrics as a table."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvbucket.cli import output
from kvbucket.cli.common import MAX_TIMEOUT_S, TIMEOUT_ENV, fail, first_answer_deadline
from kvbucket.cli.output import Format, FormatOpt, JsonOpt, wants_json

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_URL = "http://127.0.0.1:9464/metrics"
STATS_TIMEOUT_S = 10.0

StatsTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", envvar=TIMEOUT_ENV, min=0.1, max=MAX_TIMEOUT_S,
        help=f"Seconds the command may take, counted from its start: an endpoint that accepts connections "
        f"but does not answer (or answers too slowly) fails after this (default {STATS_TIMEOUT_S:g}; "
        f"also ${TIMEOUT_ENV}).",
    ),
]


def fetch_metrics(url: str, timeout: float = STATS_TIMEOUT_S, deadline: float | None = None) -> str:
    """GET an exposition text, the whole answer by ``deadline`` (a monotonic instant; default
    ``timeout`` from now: urllib's timeout bounds each socket read, which a server trickling its
    answer never trips); errors say which URL failed and why, in words."""
    from kvbucket.stores.deadline import run_abandonable

    if not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{url!r} is not an http(s) URL, e.g. {DEFAULT_URL}", param_hint="--url")
    deadline = deadline if deadline is not None else time.monotonic() + timeout
    try:
        # urllib's own timeout a little later than the deadline: one message for a silent server
        return run_abandonable(lambda: _get(url, max(0.1, deadline - time.monotonic()) + 1.0), deadline,
                               _NoAnswer)
    except _NoAnswer:
        raise fail(f"no answer from {url} within {timeout:g} s: something accepts connections there but "
                   "sends no metrics; check that --url (or $KVBUCKET_METRICS_URL) is the process's metrics "
                   f"endpoint (e.g. {DEFAULT_URL}), or raise --timeout", 1) from None


class _NoAnswer(Exception):
    """The endpoint's whole answer did not arrive by the deadline."""


def _get(url: str, timeout: float) -> str:
    """:func:`fetch_metrics`'s request, each socket read within ``timeout``."""
    import urllib.error  # here: urllib.request (http.client, ssl) is ~25 ms of every `kvbucket` start
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        raise typer.BadParameter(f"{url} answered HTTP {e.code}; is it a /metrics endpoint?") from None
    except (urllib.error.URLError, OSError) as e:  # a runtime failure (exit 1), not a usage error
        reason = getattr(e, "reason", e)
        raise fail(
            f"cannot reach {url} ({reason}); "
            "start the process with kvbucket.metrics.start_metrics_server(port)", 1
        ) from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def render_summary(exposition: str, console: Console, title: str = "kvbucket metrics") -> bool:
    """Print the per-tier / per-store table (and prefix-reuse totals). False when nothing is there."""
    from kvbucket.metrics_summary import summarize  # not kvbucket.metrics: it imports the store stack

    summary = summarize(exposition)
    if not (summary.rows or summary.prefix_tokens or summary.integrity_verified or summary.breakers
            or summary.disk_skipped_full or summary.fleets):
        return False
    table = output.table(
        ("kind", "left"), ("name", "left"), ("hits", "right"), ("misses", "right"), ("hit ratio", "right"),
        ("writes", "right"), ("errors", "right"), ("read", "right"), ("written", "right"),
        ("mean get", "right"), title=title,
    )
    for r in summary.rows:
        ratio = "-" if r.hit_ratio is None else f"{100 * r.hit_ratio:.0f}%"
        latency = "-" if r.mean_read_ms is None else f"{r.mean_read_ms:.1f} ms"
        table.add_row(
            r.kind, r.name, f"{r.hits:.0f}", f"{r.misses:.0f}", ratio, f"{r.writes:.0f}", f"{r.errors:.0f}",
            _fmt_bytes(r.bytes_read), _fmt_bytes(r.bytes_written), latency,
        )
    if summary.rows:
        console.print(table)
    for store, (state, refused) in sorted(summary.breakers.items()):
        console.print(
            f"circuit breaker of {store}: {state}; {refused:.0f} objects refused while open",
            markup=False, highlight=False, soft_wrap=True,
        )
    for directory, skipped in sorted(summary.disk_skipped_full.items()):
        console.print(
            f"disk tier {directory}: {skipped:.0f} chunks skipped, filesystem full (the other tiers "
            "stored them)",
            markup=False, highlight=False, soft_wrap=True,
        )
    for (store, node), f in sorted(summary.fleets.items()):
        cap = f.get("capacity", 0.0)
        of = f" of {_fmt_bytes(cap)} ({100 * f.get('used', 0.0) / cap:.0f}%)" if cap else " (no capacity)"
        console.print(
            f"fleet on {store} (node {node}): {_fmt_bytes(f.get('used', 0.0))}{of} in "
            f"{f.get('chunks', 0.0):.0f} chunks, {f.get('live_nodes', 0.0):.0f} live nodes",
            markup=False, highlight=False, soft_wrap=True,
        )
    if summary.fleet_evictions:
        own, other = summary.fleet_evictions.get("self", 0.0), summary.fleet_evictions.get("other", 0.0)
        console.print(f"fleet evictions: {own:.0f} of this process's chunks, {other:.0f} other nodes'")
    if summary.prefix_tokens:
        hit = summary.prefix_tokens.get("hit", 0.0)
        computed = summary.prefix_tokens.get("computed", 0.0)
        total = hit + computed
        share = f" ({100 * hit / total:.0f}% of prompt tokens)" if total else ""
        chunks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(summary.prefix_chunks.items()))
        console.print(
            f"prefix reuse: {hit:.0f} tokens loaded, {computed:.0f} computed{share}; chunks: {chunks}"
        )
    if summary.integrity_verified or summary.integrity_failures:
        verified = sum(summary.integrity_verified.values())
        refused = sum(summary.integrity_failures.values())
        failures = sorted(summary.integrity_failures.items())
        why = ", ".join(f"{tier} {reason} {n:.0f}" for (tier, reason), n in failures)
        removed = sum(summary.integrity_removed.values())
        kept = f"; {removed:.0f} removed as damaged, {refused - removed:.0f} kept" if refused else ""
        console.print(
            f"integrity: {verified:.0f} objects verified on load, {refused:.0f} refused"
            + (f" ({why})" if why else "") + kept,
            markup=False, highlight=False, soft_wrap=True,  # one line, however many reasons
        )
    return True


def summary_dict(exposition: str, url: str) -> dict[str, Any]:
    """``stats --format json``: the summary with stable snake_case field names (docs/cli.md)."""
    from kvbucket.metrics_summary import summarize  # not kvbucket.metrics: it imports the store stack

    s = summarize(exposition)
    return {
        "url": url,
        "rows": [{**asdict(r), "hit_ratio": r.hit_ratio, "mean_read_ms": r.mean_read_ms} for r in s.rows],
        "breakers": [{"store": k, "state": st, "refused": n} for k, (st, n) in sorted(s.breakers.items())],
        "disk_skipped_full": [{"directory": d, "chunks": n} for d, n in sorted(s.disk_skipped_full.items())],
        "fleets": [{"store": st, "node": node, **g} for (st, node), g in sorted(s.fleets.items())],
        "fleet_evictions": s.fleet_evictions,
        "prefix_tokens": s.prefix_tokens,
        "prefix_chunks": s.prefix_chunks,
        "integrity": {
            "verified": s.integrity_verified,
            "refused": [{"tier": t, "reason": why, "objects": n}
                        for (t, why), n in sorted(s.integrity_failures.items())],
            "removed": s.integrity_removed,
        },
    }


def register(app: typer.Typer) -> None:
    @app.command("stats")
    def stats(
        url: str = typer.Option(
            None,
            "--url",
            help=f"The process's metrics endpoint (default: $KVBUCKET_METRICS_URL or {DEFAULT_URL}).",
        ),
        fmt: FormatOpt = Format.table,
        as_json: JsonOpt = False,
        timeout: StatsTimeoutOpt = STATS_TIMEOUT_S,
    ) -> None:
        """Summarise hits, misses, bytes and latency per tier and per store of a running process."""
        target = url or os.environ.get("KVBUCKET_METRICS_URL") or DEFAULT_URL
        exposition = fetch_metrics(target, timeout, first_answer_deadline(timeout))
        if wants_json(fmt, as_json):
            output.print_json(summary_dict(exposition, target))
            return
        console = output.console()
        if not render_summary(exposition, console, title=f"kvbucket metrics at {target}"):
            console.print(f"{target} exposes no kvbucket metrics yet (no cache traffic since it started).")
