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

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import typer

from kvbucket.cli import output
from kvbucket.cli.common import (
    DEFAULT_TIMEOUT_S,
    TimeoutOpt,
    describe_target,
    exit_code_for,
    fail,
    opened_store,
    refuse_ambiguous,
    store_url,
)
from kvbucket.cli.output import (
    Format,
    FormatOpt,
    JsonOpt,
    ListFormat,
    print_json,
    stream_json_array,
    wants_json,
)
from kvbucket.errors import InvalidKeyError
from kvbucket.keys import key_to_name, name_to_key
from kvbucket.progress import Progress
from kvbucket.secrets import redact
from kvbucket.stores import ObjectInfo, ObjectStore, check_name
from kvbucket.stores.urls import HANDLE_SCHEME, resolve_store_url

if TYPE_CHECKING:  # imported where used: every `kvbucket` start (`--help` too) imports this module
    from kvbucket.identity.usage import Generation

RM_BATCH = 1000
URL_HELP = ("Store URL: a Hub bucket id ns/name[/prefix], hf://buckets/ns/name[/prefix], "
            "s3://bucket[/prefix], file:///dir or a path (./x is always local)")


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
        url: str = typer.Argument(..., help=URL_HELP, callback=store_url, metavar="URL"),
        prefix: str = typer.Option("", "--prefix", "-p", help="Only names starting with this string."),
        keys: bool = typer.Option(False, "--keys", "-k", help="Show cache keys, not object names."),
        fmt: ListFormat = typer.Option(
            ListFormat.table, "--format", case_sensitive=False,
            help="table: size and name per line; json: one array of {name, key, size, mtime}; quiet: "
            "names (keys with --keys) alone.",
        ),
        as_json: JsonOpt = False,
        quiet: bool = typer.Option(False, "--quiet", "-q", help="The same as --format quiet."),
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """List objects (always every object under the URL, as `hf buckets ls -R`): size in bytes,
        then the name (or decoded cache key with --keys). A namespace (alice, me) lists its buckets."""
        from kvbucket.cli.namespace_ls import list_namespace, namespace_of

        if (namespace := namespace_of(url)) is not None:
            list_namespace(namespace, as_json=wants_json(fmt, as_json),
                           quiet=quiet or fmt == ListFormat.quiet, timeout=timeout)
            return
        # the lines are the progress on a terminal; in a log, a line every few seconds on stderr too
        shown = not (output.is_terminal(sys.stdout) and output.is_terminal(sys.stderr))
        with opened_store(url, timeout) as store, Progress(f"listing {url}", unit="objects",
                                                             enabled=shown) as progress:
            listing = _counted(store.list(prefix), progress)
            if wants_json(fmt, as_json):
                stream_json_array(_ls_entry(info) for info in listing)
            elif quiet or fmt == ListFormat.quiet:
                for info in listing:
                    typer.echo(display_key(info.name) if keys else info.name)
            else:
                listed = 0
                for info in listing:
                    typer.echo(f"{info.size:>12}  {display_key(info.name) if keys else info.name}")
                    listed += 1
                if not listed:  # an empty listing says so, as `hf buckets ls` does
                    typer.echo("(empty)")

    @app.command("du")
    def du(
        url: str = typer.Argument(..., help=URL_HELP, callback=store_url, metavar="URL"),
        prefix: str = typer.Option("", "--prefix", "-p", help="Only names starting with this string."),
        fmt: FormatOpt = Format.table,
        as_json: JsonOpt = False,
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Count objects and bytes; for a prefix shared by a fleet, also its index and nodes."""
        from kvbucket.identity.usage import Generations

        count = total = 0
        gens = Generations()  # KV chunks by model and identity (kvbucket.identity.usage)
        with opened_store(url, timeout) as store:
            with Progress(f"listing {url}", unit="objects") as progress:
                for info in _counted(store.list(prefix), progress):
                    count += 1
                    total += info.size
                    gens.add(info)
            gens.read_manifests(store)  # each identity's weights and fields, from _identity/
            fleet = _fleet_status(store, prefix)
        by_identity = gens.sorted()
        if wants_json(fmt, as_json):
            print_json({"url": url, "prefix": prefix, "objects": count, "bytes": total, "fleet": fleet,
                        "by_model_identity": [g.to_dict() for g in by_identity]})
            return
        where = f"{url} (prefix {prefix!r})" if prefix else url
        objects = "1 object" if count == 1 else f"{count} objects"
        typer.echo(f"{objects}, {total} bytes ({human_size(total)}) in {where}")
        if fleet is not None:
            _echo_fleet(fleet)
        if by_identity:
            _echo_generations(by_identity)

    @app.command("rm")
    def rm(
        url: str = typer.Argument(..., help=URL_HELP, callback=store_url, metavar="URL"),
        names: list[str] = typer.Argument(
            None, help="Objects to remove: object names as `ls` prints them, or cache keys as `ls --keys` "
            "prints them.", show_default=False,
        ),
        prefix: str | None = typer.Option(
            None, "--prefix", "-p", help="Remove every object whose name starts with this string."
        ),
        yes: bool = typer.Option(False, "--yes", "-y", help="Confirm a --prefix removal."),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Only print what would be removed (no --yes needed); nothing is removed."
        ),
        model: str | None = typer.Option(
            None, "--model", help="With --identity: remove this model's KV chunks of one identity "
            "(a generation, as `du` lists them; within --prefix when given)."),
        identity: str | None = typer.Option(
            None, "--identity", help="The identity token `du` shows (or a unique prefix of it, 4 hex "
            "digits or more), or `none` for chunks written without an identity."),
        fmt: FormatOpt = Format.table,
        as_json: JsonOpt = False,
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Remove objects by name or cache key, every object under --prefix (needs --yes), or one
        model identity's chunks (--model and --identity)."""
        names = names or []
        refuse_ambiguous(url, "rm")
        if (model is None) != (identity is None):
            raise _fail("--model and --identity go together: `kvbucket du URL` lists them")
        if model is not None:
            if names:
                raise _fail("give object names or --model/--identity, not both")
            _remove_generation(url, prefix or "", model, str(identity), dry_run=dry_run,
                               as_json=wants_json(fmt, as_json), timeout=timeout)
            return
        if names and prefix is not None:
            raise _fail("give object names or --prefix, not both")
        if not names and prefix is None:
            raise _fail("nothing to remove: give object names or --prefix PREFIX --yes")
        if prefix is not None and not yes and not dry_run:
            what = f"every object under prefix {prefix!r}" if prefix else "EVERY object in the store"
            raise _fail(f"this would remove {what} of {url}; add --yes to confirm (or --dry-run to see it)")
        as_json = wants_json(fmt, as_json)
        done = Removal(dry_run=dry_run)
        with opened_store(url, timeout) as store:
            if names:
                batches: Iterable[tuple[Batch, dict[str, str | None] | None]] = (
                    (b, None) for b in _named_batches(store, names))
            else:  # what is under the prefix now goes, whatever version: no versions named
                batches = ((b, None) for b, _ in _in_batches(store.list(prefix or "", page_size=RM_BATCH)))
            _run_removal(url, store, batches, done, as_json)
        _report(done, as_json)


def _remove_generation(url: str, prefix: str, model: str, identity: str, *, dry_run: bool,
                       as_json: bool, timeout: float) -> None:
    """``rm --model --identity``: one generation's chunks and its manifest entry, in batches.

    ``identity`` is a token, a unique prefix of one (resolved by a first listing) or ``none``;
    when it names nothing (or several), exit 2 naming the identities the store holds."""
    from kvbucket.identity.usage import Generations, NoSuchIdentity, match_identity, select

    done = Removal(dry_run=dry_run)
    with opened_store(url, timeout) as store:
        # one listing first: a token or prefix that names nothing (or several) fails before anything
        # is said or removed, naming what is there (a second listing removes)
        seen = Generations()
        for info in store.list(prefix, page_size=RM_BATCH):
            seen.add(info)
        try:
            identity = match_identity(seen.sorted(), model, identity)
        except NoSuchIdentity as e:
            raise _fail(f"{e} (`kvbucket du {url}` lists them)") from None
        listed = select(store.list(prefix, page_size=RM_BATCH), model, identity)
        _run_removal(url, store, _in_batches(listed), done, as_json)  # a rewrite since is kept
    _report(done, as_json)


Batch = list[tuple[str, int | None]]  # (object name, size, or None: not found)

#: A Hub writer adds back what a delete took soon after its write (stores/hub/rechecks.py).
HUB_COMEBACK_NOTE = ("note: a name a running writer committed less than its recheck_delay_secs (default 5 s) "
                     "ago comes back: that writer adds back what a delete took right after its write "
                     "(docs/cli.md, \"Removing objects\")")


def _run_removal(url: str, store: ObjectStore, batches: Iterable[tuple[Batch, dict[str, str | None] | None]],
                 done: Removal, as_json: bool) -> None:
    """Say first what ``url`` resolved to (a bucket on which endpoint, or an absolute directory:
    a removal should never surprise), then remove batch by batch with progress on stderr. Ctrl-C
    says how many were removed and exits 130."""
    verb = "dry run on" if done.dry_run else "removing from"
    typer.echo(f"{verb} {describe_target(url, store)}", err=True)
    # dry-run lines on a terminal are the progress (as ls's are); elsewhere a line every few seconds
    on_terminal = output.is_terminal(sys.stdout) and output.is_terminal(sys.stderr)
    shown = as_json or not done.dry_run or not on_terminal
    with Progress(f"{verb} {url}", unit="objects", enabled=shown) as progress:
        try:
            for batch, versions in batches:  # versions: as listed, for rm --identity
                done.remove(store, batch, echo=not as_json, versions=versions)
                progress.advance(len(batch))
        except KeyboardInterrupt:
            progress.close(" (interrupted)")
            typer.echo(done.interrupted(), err=True)
            raise typer.Exit(130) from None
    if done.removed and not done.dry_run and resolve_store_url(url).startswith(HANDLE_SCHEME):
        typer.echo(HUB_COMEBACK_NOTE, err=True)


def _report(done: Removal, as_json: bool) -> None:
    """What an ``rm`` removed (or would): JSON or the summary line; exit 1 when a removal failed."""
    if as_json:
        print_json(done.to_dict())
    else:
        typer.echo(done.summary())
    if done.failed:
        raise typer.Exit(1)


def _echo_generations(gens: list[Generation]) -> None:
    typer.echo("KV chunks by model and identity:")
    for g in gens:
        when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(g.last_write))
                if g.last_write is not None else "unknown")
        chunks = "1 chunk" if g.chunks == 1 else f"{g.chunks} chunks"
        typer.echo(f"  {g.model}  {g.token or 'none (name only)'}: {chunks}, {g.bytes} bytes "
                   f"({human_size(g.bytes)}), last write {when}")
        if g.token is not None:  # what the identity is, from its manifest (name-only has none)
            weights = g.weights if g.weights is not None else (
                "unknown (manifest unreadable)" if g.manifest == "unreadable" else "unknown (no manifest)")
            typer.echo(f"      weights {weights or 'unknown'}; {g.fields_summary()}")


def _counted(listing: Iterator[ObjectInfo], progress: Progress) -> Iterator[ObjectInfo]:
    for info in listing:
        progress.advance(1)
        yield info


def _ls_entry(info: ObjectInfo) -> dict[str, Any]:
    key = display_key(info.name)
    return {"name": info.name, "key": key if key != info.name else None, "size": info.size,
            "mtime": info.mtime}


class Removal:
    """What an ``rm`` removed (or, with ``dry_run``, would remove), object by object."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.removed: list[tuple[str, int | None]] = []
        self.missing: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.in_flight = 0  # objects of the delete under way

    def remove(self, store: ObjectStore, batch: list[tuple[str, int | None]], echo: bool,
               versions: dict[str, str | None] | None = None) -> None:
        """Remove the batch's objects; ``None`` sizes are objects not found (reported, not removed).
        With ``versions`` (as listed), an object written since is kept (counted as not found)."""
        present = [(name, size) for name, size in batch if size is not None]
        self.missing += [name for name, size in batch if size is None]
        if self.dry_run:
            self.removed += present
            if echo:
                for name, size in present:
                    typer.echo(f"would remove {name} ({size} bytes)")
            return
        errors: dict[str, list[str]] = {}
        self.in_flight = len(present)  # an interrupt now leaves these unknown (some may be gone)
        results = _delete(store, [n for n, _ in present], versions)
        self.in_flight = 0
        for r, (name, size) in zip(results, present, strict=True):
            if r.error is None and getattr(r, "changed", False):
                self.missing.append(name)  # written since it was listed: kept
            elif r.error is not None:
                self.failed.append((name, str(r.error)))
                if exit_code_for(r.error) == 2:  # a refused token: no other object will go
                    before = f" ({len(self.removed)} removed before)" if self.removed else ""
                    raise fail(f"{r.error}{before}", 2)
                errors.setdefault(str(r.error), []).append(name)
            else:
                self.removed.append((name, size))
        if echo:
            for text, failed_names in errors.items():  # one line per cause, not per object
                which = failed_names[0] if len(failed_names) == 1 else \
                    f"{len(failed_names)} objects ({failed_names[0]}, ...)"
                typer.echo(f"error: {redact(f'{which}: {text}')}", err=True)

    def interrupted(self) -> str:
        """What an interrupted ``rm`` did, for the line it leaves on stderr."""
        if self.dry_run:
            return f"interrupted: listed {len(self.removed):,} to remove; nothing was removed (dry run)"
        n = len(self.removed)
        text = f"interrupted: removed {n:,} object{'' if n == 1 else 's'}"
        if self.in_flight:
            text += f"; {self.in_flight:,} more were being removed and may be gone too"
        return text + "; the others were not removed (run the same command again to go on)"

    def summary(self) -> str:
        parts = [f"{'would remove' if self.dry_run else 'removed'} {len(self.removed)}"]
        if self.missing:
            parts.append(f"{len(self.missing)} not found")
        if self.failed:
            parts.append(f"{len(self.failed)} failed")
        return ("(dry run) " if self.dry_run else "") + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "removed": [{"name": n, "size": s} for n, s in self.removed],
            "not_found": self.missing,
            "failed": [{"name": n, "error": redact(e)} for n, e in self.failed],
            "bytes": sum(s or 0 for _, s in self.removed),
        }


def _delete(store: ObjectStore, names: list[str], versions: dict[str, str | None] | None) -> list[Any]:
    """``delete_many``, or with the listed versions, the delete that names each (a name listed
    with no version, by a store that gives none, as it is)."""
    if versions is None or not names:
        return store.delete_many(names)
    from kvbucket.stores.guard.refusals import delete_judged

    known = [n for n in names if versions.get(n) is not None]
    done = {r.name: r for r in delete_judged(store, [(n, str(versions[n])) for n in known], "rm")}
    if plain := [n for n in names if versions.get(n) is None]:
        done.update((r.name, r) for r in store.delete_many(plain))
    return [done[n] for n in names]


def names_for(given: str) -> list[str]:
    """The object names ``given`` may mean: itself (an object name as ``ls`` prints it), then the
    name of each cache key reading ``ls --keys`` prints (``dir/key``, where the key may hold
    ``/`` itself, e.g. a model name): every split at a ``/`` whose right side is a key."""
    out: list[str] = []
    with contextlib.suppress(InvalidKeyError):
        out.append(check_name(given))
    cut = -1
    while True:
        directory, key = given[:cut] if cut >= 0 else "", given[cut + 1 :]
        try:
            name = key_to_name(key, directory)
        except InvalidKeyError:
            name = None
        if name is not None and name not in out:
            out.append(name)
        cut = given.find("/", cut + 1)
        if cut < 0:
            return out


def _named_batches(store: ObjectStore, names: list[str]) -> list[list[tuple[str, int | None]]]:
    """(object name, size or None when missing) of each name or key given, in batches, all resolved
    before anything is removed: a given string that is neither an object name nor the key of an
    existing object refuses the whole call (InvalidKeyError). A store may answer size=None for a
    removal it cannot size cheaply, so whether an object exists is asked first."""
    out: list[list[tuple[str, int | None]]] = []
    for batch in _batches(names):
        candidates = {given: names_for(given) for given in batch}
        asked = list(dict.fromkeys(n for c in candidates.values() for n in c))
        sizes = {r.name: r.size for r in store.head_many(asked)} if asked else {}
        resolved: list[tuple[str, int | None]] = []
        for given, cands in candidates.items():
            found = next((c for c in cands if sizes.get(c) is not None), None)
            if found is None:
                check_name(given)  # not a key of an existing object: a bad name is refused
            resolved.append((found, sizes[found]) if found is not None else (given, None))
        out.append(list(dict.fromkeys(resolved)))
    return out


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


def _in_batches(listed: Iterable[ObjectInfo]) -> Iterator[tuple[Batch, dict[str, str | None]]]:
    """Batches of listed (name, size), each with its objects' versions as listed; each batch is
    deleted before the listing continues."""
    batch: Batch = []
    versions: dict[str, str | None] = {}
    for info in listed:
        batch.append((info.name, info.size))
        versions[info.name] = info.version
        if len(batch) == RM_BATCH:
            yield batch, versions
            batch, versions = [], {}
    if batch:
        yield batch, versions
