"""bench_l2 on a shaped link (issue 41): LMCache's runner, both adapters, through
:class:`kvbucket.testing.shaped_link.ShapedLink` instead of straight to the server.

Why: on loopback a connection has no bandwidth limit of its own, so bench_l2's ratios say how
much CPU each adapter spends, not how it fills a real link (object stores and CDNs cap each
connection). With ``--link-mbps`` both adapters reach the Hub emulator or SeaweedFS through one
relay: each TCP connection capped at that many MB/s, all together at ``--link-total-mbps`` (0:
no cap), ``--link-rtt-ms`` per round trip. The servers' own stats probes stay direct.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-mbps", type=float, default=0.0,
                   help="through a shaped link capping each connection at this many MB/s (0: loopback)")
    p.add_argument("--link-total-mbps", type=float, default=0.0, help="the link's total cap (0: none)")
    p.add_argument("--link-rtt-ms", type=float, default=0.0, help="the link's round trip")


def describe(args: argparse.Namespace) -> str:
    """``link 8 MB/s/conn, rtt 20 ms`` (for titles and the variant), or '' on loopback."""
    if not args.link_mbps:
        return ""
    total = f", total {args.link_total_mbps:g} MB/s" if args.link_total_mbps else ""
    return f"link {args.link_mbps:g} MB/s/conn{total}, rtt {args.link_rtt_ms:g} ms"


def variant(args: argparse.Namespace) -> list[str]:
    """The results file's variant parts: ``link8-20ms`` (and ``total64``)."""
    if not args.link_mbps:
        return []
    return [f"link{args.link_mbps:g}-{args.link_rtt_ms:g}ms"
            + (f"-total{args.link_total_mbps:g}" if args.link_total_mbps else "")]


def _target(backend: str, builtin: dict[str, Any], env: dict[str, str]) -> str:
    """``host:port`` of the server both adapters reach."""
    if backend == "hfbucket":
        return urlsplit(env["HF_ENDPOINT"]).netloc
    if backend == "s3":
        return str(builtin["s3_endpoint"]).split("/", 1)[0]
    raise ValueError(f"--link-mbps needs a network backend (hfbucket, s3), not {backend}")


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    return value


@contextlib.contextmanager
def through_link(found: tuple[dict, dict, dict[str, str], dict], backend: str,
                 args: argparse.Namespace) -> Iterator[tuple[dict, dict, dict[str, str], dict]]:
    """The servers' adapter specs and environment, pointed at a shaped link in front of them
    (``found`` unchanged without ``--link-mbps``)."""
    if not args.link_mbps:
        yield found
        return
    from kvbucket.testing.shaped_link import ShapedLink

    builtin, ours, env, probe = found
    target = _target(backend, builtin, env)
    host, _, port = target.rpartition(":")
    with ShapedLink(int(port), per_conn_bps=args.link_mbps * 1e6, rtt_s=args.link_rtt_ms / 1000,
                    total_bps=args.link_total_mbps * 1e6 or None, target_host=host,
                    lifetime_s=7200) as link:
        new = f"{link.host}:{link.port}"
        yield _swap(builtin, target, new), _swap(ours, target, new), _swap(env, target, new), probe
