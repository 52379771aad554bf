"""``kvbucket ls|du|rm URL``: look into and prune any object store named by a URL.

The commands speak only the :class:`~kvbucket.stores.ObjectStore` protocol through
:func:`kvbucket.stores.open_store`, so every store kvbucket knows (``file://``, paths,
``memory://``, ``hf://``, ``s3://``) works without special cases.

Output is plain lines streamed as the listing arrives (a remote listing can be long, and the
lines are easy to pipe); errors are one line on stderr with exit status 2 for unusable input
(URL, missing bucket or directory, refused token) and 1 when the store failed or could not be
reached, or some objects of an ``rm`` could not be removed (kvbucket.cli.common).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer

from kvbucket.cli.common import DEFAULT_TIMEOUT_S, TimeoutOpt, exit_code_for, fail, opened_store
from kvbucket.errors import InvalidKeyError
from kvbucket.keys import name_to_key
from kvbucket.secrets import redact
from kvbucket.stores import ObjectStore

RM_BATCH = 1000
URL_HELP = "Store URL: file:///dir, a path, memory://, hf://buckets/ns/name[/prefix], s3://bucket[/prefix]"


def human_size(n: int) -> str:
    """Bytes in binary units (KV caches are sized in GiB of memory, so 1 KiB = 1024 B)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def display_key(name: str) -> str:
    """The cache key an object name encodes (its last segment), or the name itself."""
    directory, _, _ = name.rpartition("/")
    try:
        key = name_to_key(name, directory)
    except InvalidKeyError:
        return name
    return f"{directory}/{key}" if directory else key


_fail = fail


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(
        url: str = typer.Argument(..., help=URL_HELP),
        prefix: str = typer.Option("", "--prefix", "-p", help="Only names starting with this string."),
        keys: bool = typer.Option(False, "--keys", "-k", help="Show cache keys, not object names."),
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """List objects: size in bytes, then the name (or decoded cache key with --keys)."""
        with opened_store(url, timeout) as store:
            for info in store.list(prefix):
                typer.echo(f"{info.size:>12}  {display_key(info.name) if keys else info.name}")

    @app.command("du")
    def du(
        url: str = typer.Argument(..., help=URL_HELP),
        prefix: str = typer.Option("", "--prefix", "-p", help="Only names starting with this string."),
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Count objects and bytes; for a prefix shared by a fleet, also its index and nodes."""
        count = total = 0
        with opened_store(url, timeout) as store:
            for info in store.list(prefix):
                count += 1
                total += info.size
            fleet = _fleet_status(store, prefix)
        where = f"{url} (prefix {prefix!r})" if prefix else url
        objects = "1 object" if count == 1 else f"{count} objects"
        typer.echo(f"{objects}, {total} bytes ({human_size(total)}) in {where}")
        if fleet is not None:
            _echo_fleet(fleet)

    @app.command("rm")
    def rm(
        url: str = typer.Argument(..., help=URL_HELP),
        names: list[str] = typer.Argument(None, help="Object names to remove.", show_default=False),
        prefix: str | None = typer.Option(
            None, "--prefix", "-p", help="Remove every object whose name starts with this string."
        ),
        yes: bool = typer.Option(False, "--yes", "-y", help="Confirm a --prefix removal."),
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Remove objects by name, or every object under --prefix (needs --yes)."""
        names = names or []
        if names and prefix is not None:
            raise _fail("give object names or --prefix, not both")
        if not names and prefix is None:
            raise _fail("nothing to remove: give object names or --prefix PREFIX --yes")
        if prefix is not None and not yes:
            what = f"every object under prefix {prefix!r}" if prefix else "EVERY object in the store"
            raise _fail(f"this would remove {what} of {url}; add --yes to confirm")
        removed = missing = failed = 0
        with opened_store(url, timeout) as store:
            for batch in _batches(names) if names else _listed_batches(store, prefix or ""):
                # A store may answer size=None for a removal it cannot size cheaply, so whether a
                # named object existed is asked first: only objects that were there count.
                existed = [r.found for r in store.head_many(batch)] if names else [True] * len(batch)
                errors: dict[str, list[str]] = {}
                for r, was_there in zip(store.delete_many(batch), existed, strict=True):
                    if r.error is not None:
                        failed += 1
                        if exit_code_for(r.error) == 2:  # a refused token: no other object will go
                            done = f" ({removed} removed before)" if removed else ""
                            raise _fail(f"{r.error}{done}", 2)
                        errors.setdefault(str(r.error), []).append(r.name)
                    elif r.size is not None or was_there:
                        removed += 1
                    else:
                        missing += 1
                for text, failed_names in errors.items():  # one line per cause, not per object
                    which = failed_names[0] if len(failed_names) == 1 else \
                        f"{len(failed_names)} objects ({failed_names[0]}, ...)"
                    typer.echo(f"error: {redact(f'{which}: {text}')}", err=True)
        parts = [f"removed {removed}"]
        if missing:
            parts.append(f"{missing} not found")
        if failed:
            parts.append(f"{failed} failed")
        typer.echo(", ".join(parts))
        if failed:
            raise typer.Exit(1)


def _fleet_status(store: ObjectStore, prefix: str) -> dict[str, Any] | None:
    """The fleet's index of ``prefix`` (docs/fleet.md), or None when no fleet uses it."""
    from kvbucket.fleet.report import inspect_fleet
    from kvbucket.stores.base import check_prefix

    try:
        fleet_prefix = check_prefix(prefix)
    except InvalidKeyError:
        return None
    return inspect_fleet(store, fleet_prefix)


def _echo_fleet(fleet: dict[str, Any]) -> None:
    used = int(fleet["bytes_used"])
    typer.echo(f"fleet index: {fleet['chunks']} chunks, {used} bytes ({human_size(used)}), "
               f"snapshot generation {fleet['snapshot_generation']}")
    for salt, size in sorted(fleet["bytes_by_cache_salt"].items()):
        share = f"{100 * size / used:.1f}%" if used else "-"
        typer.echo(f"  salt {salt or '(none)'!r}: {size} bytes ({human_size(size)}, {share})")
    live = set(fleet["live_nodes"])
    for node, ago in sorted(fleet["nodes"].items(), key=lambda kv: kv[1]):
        typer.echo(f"  node {node}: last seen {ago:.0f} s ago{'' if node in live else ' (gone)'}")


def _batches(names: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(names), RM_BATCH):
        yield names[i : i + RM_BATCH]


def _listed_batches(store: ObjectStore, prefix: str) -> Iterator[list[str]]:
    """Batches of listed names; each batch is deleted before the listing continues."""
    batch: list[str] = []
    for info in store.list(prefix, page_size=RM_BATCH):
        batch.append(info.name)
        if len(batch) == RM_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
