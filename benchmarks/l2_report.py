"""What ``bench_l2.py`` prints and records: the goals per shape, the compared rows, ratio tables,
the results file's name and rows. Apart from the runner so each file holds one idea."""

from __future__ import annotations

import argparse
from typing import Any

import l2_link  # this script's directory

#: In this order: a round's keys are first read by a lookup and a load apart (read-ahead off, so
#: nothing is read ahead or cached for them), then by lookup + load; LMCache's adapter runs all
#: four, so its lookup + load comes after its own load of the same keys (any cache it keeps helps it).
OPS = ("Store", "Lookup", "Load", "Lookup+Load")
#: The kvbucket side with read-ahead off, whose lookup and load are timed apart.
RA_OFF = "kvbucket-ra-off"

#: Goals in LMCache's runner at 0 ms, kvbucket / LMCache's ``hfbucket`` adapter, per shape (keys, KiB).
#: Issue 23: store >= 1.0x, load >= 1.5x, where load = lookup + load with read-ahead on (the figure a
#: hit costs), at 64 x 2 MiB and 16 x 8 MiB. Issue 30 at 64 x 2 MiB: with read-ahead off, load
#: >= 1.5x and store >= 1.1x. S3's goals are at 50 ms (bench_latency); a lookup alone has none.
GOALS = {
    (64, 2048): {("hfbucket", "Store"): 1.1, ("hfbucket", "Lookup+Load"): 1.5, ("hfbucket", "Load"): 1.5},
    (16, 8192): {("hfbucket", "Store"): 1.0, ("hfbucket", "Lookup+Load"): 1.5},
}


def goal_for(backend: str, op: str, num_keys: int, data_size_kb: int, random_payloads: bool) -> float | None:
    """The ratio issues 23 and 30 ask of this row, or None where they set no goal (a ``goal`` column that
    says MISSED on a row nobody set a goal for misleads the reader)."""
    if not random_payloads:  # constant payloads: the dedup case, no goal
        return None
    return GOALS.get((num_keys, data_size_kb), {}).get((backend, op))


def paired(base_secs: list[float], secs: list[float]) -> str:
    """Throughput ratio round by round (``base`` time / time; the two ran back to back in each
    round, so load drift between rounds cancels): median and quartiles, as text."""
    import statistics

    ratios = sorted(b / t for b, t in zip(base_secs, secs, strict=True) if 0 < t < float("inf"))
    if len(ratios) < 4:
        return "n/a"
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return f"{med:.3f} [{q1:.2f}-{q3:.2f}]"


def mean_runs(runs: list[dict]) -> dict:
    out: dict[str, Any] = {"verified": all(r["verified"] for r in runs)}
    for op in ("Store", "Lookup", "Load"):  # what `lmcache bench l2` times
        out[op] = {"ops_per_sec_avg": sum(r[op]["ops_per_sec_avg"] for r in runs) / len(runs)}
    return out


def variant(args: argparse.Namespace) -> str | None:
    """A results file per setting (``bench_l2-s3-constant``), so that one setting's run does not
    replace another's; the default setting writes ``bench_l2.json``."""
    parts = []
    if args.backends.replace(" ", "") != "hfbucket,s3":
        parts.append(args.backends.replace(" ", "").replace(",", "+"))
    if (args.num_keys, args.data_size_kb) != (64, 2048):
        parts.append(f"{args.num_keys}x{args.data_size_kb}k")
    parts += [flag for flag, on in (("constant", not (args.random_payloads or args.integrity)),
                                    ("random", (args.random_payloads or args.integrity) and
                                     getattr(args, "payloads", "random") == "random"),
                                    ("lmcache-format", args.object_format == "lmcache"),
                                    ("integrity", args.integrity), ("cli", args.mode == "cli")) if on]
    parts += l2_link.variant(args)
    return "-".join(parts) or None


#: What is compared with LMCache's adapter: (operation, kvbucket side, results key, what the
#: row says). Lookup and load apart only with read-ahead off (see the module's docstring).
COMPARED: list[tuple[str, str, str, str]] = [
    ("Store", "kvbucket", "store", "store"),
    ("Lookup+Load", "kvbucket", "lookup+load", "lookup + load (read-ahead on)"),
    ("Lookup", RA_OFF, "lookup", "lookup (read-ahead off)"),
    ("Load", RA_OFF, "load", "load (read-ahead off)"),
]


def ratio_table(pairs: list[tuple[str, dict, dict[str, dict]]], args: argparse.Namespace) -> list[str]:
    """The printed ops/s and ratios; a goal only on the rows ``goal_for`` gives one."""
    lines = [f"{'backend':<9} {'op':<34} {'lmcache ops/s':>14} {'kvbucket ops/s':>15} {'ratio':>7}  goal"]
    for backend, base, mine in pairs:
        for op, who, _key, what in COMPARED:
            if op not in mine.get(who, {}):
                continue
            base_ops, my_ops = base[op]["ops_per_sec_avg"], mine[who][op]["ops_per_sec_avg"]
            ratio = my_ops / base_ops if base_ops > 0 else float("inf")
            goal = goal_for(backend, op, args.num_keys, args.data_size_kb, args.random_payloads)
            mark = "" if goal is None else f">={goal}x " + ("ok" if ratio >= goal else "MISSED")
            row = f"{backend:<9} {what:<34} {base_ops:>14.1f} {my_ops:>15.1f} {ratio:>6.2f}x  {mark}"
            lines.append(row.rstrip())
    return lines


def record(res: Any, args: argparse.Namespace, pairs: list[tuple[str, dict, dict[str, dict]]]) -> None:
    """Ops/s of LMCache's adapter and kvbucket's per backend and operation (``COMPARED``), with
    per-round ratios when interleaved; every round's seconds of every side."""
    kb = args.data_size_kb
    shape = f"{args.num_keys} x " + (f"{kb // 1024} MiB" if kb % 1024 == 0 else f"{kb} KiB")
    shape += f", {l2_link.describe(args)}" if args.link_mbps else ""
    for backend, base, mine in pairs:
        off = " and prefetch_reconstructions off" if backend == "hfbucket" else " off"
        for op in OPS:
            if op not in base:
                continue
            sides = {f"{w.replace('-', '_')}_s": m[op].get("round_secs", [])
                     for w, m in mine.items() if op in m}
            for i, tb in enumerate(base[op].get("round_secs", [])):
                res.run(backend=backend, op=op, round=i + 1, lmcache_s=tb,
                        **{k: v[i] if i < len(v) else None for k, v in sides.items()})
        for op, who, key, what in COMPARED:
            if op not in base or op not in mine.get(who, {}):
                continue
            goal = goal_for(backend, op, args.num_keys, args.data_size_kb, args.random_payloads)
            b, m = base[op], mine[who][op]
            rb, rm = b.get("round_secs", []), m.get("round_secs", [])
            name, _, note = what.removesuffix(")").partition(" (")
            note = note.replace(" off", off) if who == RA_OFF else note
            res.compare(f"{backend} {key}", f"{backend} {name} ({shape}" + (f", {note})" if note else ")"),
                        ours=m["ops_per_sec_avg"], peer=b["ops_per_sec_avg"],
                        peer_name=f"LMCache {backend} adapter", unit="keys/s",
                        goal=None if goal is None else f">= {goal}",
                        verified=bool(base["verified"] and mine[who]["verified"]),
                        ratios=[tb / tm for tb, tm in zip(rb, rm, strict=False) if 0 < tm < float("inf")])
