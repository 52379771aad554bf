"""``kvbucket verify URL``: check every object's envelope in a store, optionally remove bad ones.

Each object is read whole and classified (:func:`kvbucket.stores.guard.sealed.inspect_object`):

- ``good``: a kvbucket envelope whose header, length and checksum verify;
- ``corrupt``: damaged (checksum, truncated, wrong length, damaged header);
- ``foreign``: intact but not this object's, or not readable here (written under another name,
  for another layout, in a newer format; with a keyring, sealed under a key the ring does not
  hold or that fails to authenticate);
- ``legacy``: no envelope (written before sealing, or by another program such as LMCache);
- ``bookkeeping``: kvbucket's own objects beside the chunks (``_identity/`` manifests, the
  fleet's ``_fleet/`` journals, snapshots, heartbeats and digest), named, never read as chunks.

A URL above the tiers' roots (a bucket's root, with tiers under ``kv/``, ``llama/``, ...) verifies
too: an object whose envelope binds a name relative to a prefix below the URL is checked under
that prefix, and the report groups objects by the prefix they verify under.

Compile-cache objects keep the compiler's own files, verified by sha256 instead of an envelope:
a pack against the digest in its name, a file listed in its entry's checksum record against the
record (see :mod:`kvbucket.compile_cache.sums`); they are ``good`` or ``corrupt`` like chunks.

Exit status 1 when anything is corrupt or foreign, 2 for unusable input, 0 otherwise.
``--delete-bad`` removes what the one rule of :mod:`kvbucket.stores.guard.refusals` removes: objects
whose bytes contradict their own envelope (corrupt ones), each read again afresh and removed only
when damaged again, by the version read (an object written since, or intact on the second read,
is kept and counted as kept). Legacy objects and foreign ones
(written under another name, for another layout, format or key) are reported, never deleted:
they may be valid for another reader. When most objects are misnamed, the URL is said to look
wrong (with the one to give).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvbucket.batching import batches
from kvbucket.cli import output
from kvbucket.cli.common import DEFAULT_TIMEOUT_S, TimeoutOpt, fail, opened_store, refuse_ambiguous, store_url
from kvbucket.cli.output import Format, FormatOpt, JsonOpt, wants_json
from kvbucket.cli.store_cmd import human_size
from kvbucket.errors import KVBucketError
from kvbucket.progress import Progress
from kvbucket.stores.base import ObjectInfo, ObjectStore

if TYPE_CHECKING:  # imported where used: every `kvbucket` start (`--help` too) imports this module
    from kvbucket.encryption import Keyring

STATUSES = ("good", "corrupt", "foreign", "legacy", "bookkeeping")
BATCH_BYTES = 64 << 20
BATCH_ITEMS = 64
SHOWN_BAD = 20


def _batches(infos: Sequence[ObjectInfo]) -> Iterator[list[ObjectInfo]]:
    return batches(infos, lambda x: x.size, BATCH_ITEMS, BATCH_BYTES)


#: compile-cache file -> (size, sha256), from the checksum records in the store
Sums = dict[str, tuple[int, str]]


def compile_cache_sums(store: ObjectStore, infos: Sequence[ObjectInfo]) -> Sums:
    """file -> (size, sha256) from every compile-cache checksum record among ``infos``."""
    from kvbucket.compile_cache.sums import SUMS_PREFIX, recorded_files  # the CLI starts without it

    records = [i for i in infos if i.name.startswith(SUMS_PREFIX) or f"/{SUMS_PREFIX}" in i.name]
    out: Sums = {}
    for batch in _batches(records):
        for r in store.get_many([i.name for i in batch]):
            if r.error is not None:
                raise r.error
            if r.data is not None:
                base = r.name[: r.name.index(SUMS_PREFIX)]  # the compile cache's root in this store
                out.update({base + n: v for n, v in recorded_files(bytes(r.data)).items()})
    return out


def bookkeeping_kind(name: str) -> tuple[str, str] | None:
    """(what it is, the prefix it belongs to) when ``name`` is kvbucket's bookkeeping (a manifest, a
    fleet object), else None."""
    from kvbucket.fleet.layout import FLEET_DIR, parse_name
    from kvbucket.identity.manifest import DIR, parse_manifest_name

    parts = name.split("/")
    for i, seg in enumerate(parts):
        prefix = "/".join(parts[:i])
        if seg == FLEET_DIR and (fleet := parse_name(name, prefix)) is not None:
            return _FLEET_KINDS[fleet.kind], prefix
        if seg == DIR and parse_manifest_name(name, prefix) is not None:
            return "identity manifest", prefix
    return None


_FLEET_KINDS = {"j": "fleet journal", "s": "fleet snapshot", "n": "fleet heartbeat", "d": "fleet digest"}


def classify(name: str, data: Any, size: int, keyring: Keyring | None, sums: Sums) -> tuple[str, str | None]:
    """(status, reason) of one object: a compile-cache file by its sha256, anything else by envelope."""
    from kvbucket.compile_cache.sums import pack_digest, sha256_of
    from kvbucket.stores.guard.sealed import inspect_object

    digest = pack_digest(name)
    if digest is None and name in sums:
        want, digest = sums[name]
        if size != want:
            return "corrupt", "length"
    if digest is not None:
        return ("good", None) if sha256_of(data) == digest else ("corrupt", "checksum")
    return inspect_object(name, data, keyring)


@dataclass
class Scan:
    """What ``verify`` found: counts and bytes per status, (name, status, reason) of every object
    not good, and the roots below the URL that objects written under another name verify at."""

    totals: dict[str, list[int]]
    bad: list[tuple[str, str, str]] = field(default_factory=list)
    sums: Sums = field(default_factory=dict)
    below: Counter[str] = field(default_factory=Counter)  # root (relative to the URL) -> objects
    #: prefix the objects verify under ("" = the URL) -> status -> objects (bookkeeping by its prefix)
    by_prefix: dict[str, Counter[str]] = field(default_factory=dict)
    #: object -> the name it was checked as, for those bound below the URL (relative to their prefix)
    checked_as: dict[str, str] = field(default_factory=dict)

    def count(self, prefix: str, status: str, size: int) -> None:
        self.totals[status][0] += 1
        self.totals[status][1] += size
        self.by_prefix.setdefault(prefix, Counter())[status] += 1

    def wrong_url(self, url: str) -> str | None:
        """Why the URL looks wrong (most names bound to another root), with the fix; None if not.

        Objects written under another name are kept either way (not damage: their writer's root
        may differ); those bound to a root below the URL were checked there (``by_prefix``), and
        only the foreign ones among them are named (a corrupt one is corrupt wherever it is
        checked); when most of the rest are misnamed, the URL is the likelier culprit.
        """
        misnamed = sum(1 for _, _, reason in self.bad if reason == "name")
        enveloped = sum(self.totals[s][0] for s in ("good", "corrupt", "foreign"))
        if self.below:
            root, n = self.below.most_common(1)[0]
            return (f"{sum(self.below.values())} objects bound to a directory below the URL are foreign "
                    f"there too ({n} under {root + '/'!r}): intact, but written for another layout, "
                    f"format or key; kvbucket verify {url.rstrip('/')}/{root} checks that tier alone")
        if misnamed and 2 * misnamed > enveloped:
            return (f"the URL looks wrong: {misnamed} of {enveloped} objects were written under other "
                    "names. Give the URL the tier writes to (envelopes bind names relative to it)")
        return None


def scan(store: ObjectStore, infos: Sequence[ObjectInfo], keyring: Keyring | None,
         progress: Progress | None) -> Scan:
    """Read and classify every object of ``infos``."""
    from kvbucket.stores.guard.envelope_open import written_under

    sums = compile_cache_sums(store, infos)
    out = Scan({s: [0, 0] for s in STATUSES}, sums=sums)
    bad = out.bad
    chunks = []
    for info in infos:
        if (kind := bookkeeping_kind(info.name)) is not None:  # not read: its format is not an envelope
            out.count(kind[1], "bookkeeping", info.size)
        else:
            chunks.append(info)
    if progress is not None:
        progress.advance(sum(i.size for i in infos) - sum(i.size for i in chunks))
    for batch in _batches(chunks):
        for info, r in zip(batch, store.get_many([i.name for i in batch]), strict=True):
            if r.error is not None:
                raise r.error
            if r.data is None:  # removed since the listing
                continue
            size, prefix = int(r.size or 0), ""
            status, reason = classify(info.name, r.data, size, keyring, sums)
            if reason == "name" and (below := written_under(info.name, r.data)) is not None:
                # bound to a root below the URL (a tier under a prefix): checked as that tier reads it
                prefix = info.name[: -len(below) - 1]
                status, reason = classify(below, r.data, size, keyring, sums)
                out.checked_as[info.name] = below
                if status == "foreign":
                    out.below[prefix] += 1
            out.count(prefix, status, size)
            if status != "good":
                bad.append((info.name, status, reason or ""))
        if progress is not None:
            progress.advance(sum(i.size for i in batch))
    return out


def remove_damaged(store: ObjectStore, names: Sequence[str], keyring: Keyring | None, sums: Sums,
                   checked_as: dict[str, str] | None = None) -> tuple[int, int]:
    """Read ``names`` again afresh, and remove those damaged again, naming the version read:
    (removed, kept: written since, intact when read again, or unreadable now). Each is judged as
    the scan checked it (``checked_as``: relative to the prefix below the URL it is bound to)."""
    checked_as = checked_as or {}
    from kvbucket.stores.guard.refusals import delete_judged, removable

    removed = kept = 0
    for i in range(0, len(names), BATCH_ITEMS):
        doomed = []
        for r in store.get_versions(names[i : i + BATCH_ITEMS]):
            if r.error is not None or r.size is None or r.version is None:
                kept += r.error is not None
                continue
            status, reason = classify(checked_as.get(r.name, r.name), r.data, int(r.size), keyring, sums)
            if status == "corrupt" and reason is not None and removable(reason):
                doomed.append((r.name, r.version))
            else:
                kept += 1
        for d in delete_judged(store, doomed, "verify"):
            removed += d.removed
            kept += d.changed or d.error is not None
    return removed, kept


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify(
        url: str = typer.Argument(
            ...,
            help="Store URL (file:///dir, a path, hf://buckets/NS/NAME/PREFIX, s3://BUCKET/PREFIX): the same "
            "URL the tier writes to, since envelopes bind object names relative to it. A bucket id "
            "NS/NAME[/PREFIX] is hf://buckets/NS/NAME[/PREFIX].",
            callback=store_url, metavar="URL",
        ),
        delete_bad: bool = typer.Option(
            False, "--delete-bad",
            help="Remove damaged objects (corrupt: their bytes contradict their envelope). Legacy and "
            "foreign objects (another name, layout, format or key) are kept.",
        ),
        prefix: str = typer.Option("", "--prefix", help="Only objects whose name starts with this."),
        keyring_file: Path = typer.Option(
            None, "--keyring-file",
            help="Keyring JSON to authenticate encrypted chunks too (default: none; their checksums "
            "are verified either way).",
        ),
        fmt: FormatOpt = Format.table,
        as_json: JsonOpt = False,
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Check every object's kvbucket envelope; exit status 1 when any is corrupt or foreign."""
        from kvbucket.encryption import Keyring
        from kvbucket.stores.guard.refusals import removable

        if delete_bad:
            refuse_ambiguous(url, "verify --delete-bad")  # a removal never depends on where it runs
        as_json = wants_json(fmt, as_json)
        console = output.console()
        try:
            keyring = Keyring.from_file(keyring_file) if keyring_file is not None else None
        except KVBucketError as e:
            raise fail(str(e)) from None
        with opened_store(url, timeout) as store:
            infos = list(store.list(prefix))
            with Progress("verifying", total=sum(i.size for i in infos)) as progress:
                found = scan(store, infos, keyring, progress)
            totals, bad = found.totals, found.bad
            wrong_url = found.wrong_url(url)
            removed = kept = 0
            to_remove = [name for name, _, reason in bad if removable(reason)]
            if delete_bad and to_remove:
                removed, kept = remove_damaged(store, to_remove, keyring, found.sums, found.checked_as)
        if as_json:
            output.print_json({
                "url": store.url, "objects": len(infos),
                "totals": {s: {"objects": totals[s][0], "bytes": totals[s][1]} for s in STATUSES},
                "not_good": [{"name": n, "status": s, "reason": r} for n, s, r in bad],
                "by_prefix": {p: dict(c) for p, c in sorted(found.by_prefix.items())},
                "wrong_url": wrong_url, "delete_bad": delete_bad, "damaged": len(to_remove),
                "removed": removed, "kept": kept,
            })
            if any(status in ("corrupt", "foreign") for _, status, _ in bad):
                raise typer.Exit(1)
            return
        console.print(f"verified {len(infos)} objects in {store.url}", markup=False, highlight=False)
        table = output.table(("status", "left"), ("objects", "right"), ("bytes", "right"))
        for status in STATUSES:
            n, size = totals[status]
            table.add_row(status, str(n), human_size(size))
        console.print(table)
        _print_prefixes(console, found.by_prefix)
        for name, status, reason in bad[:SHOWN_BAD]:
            console.print(f"{status} ({reason}): {name}", markup=False, highlight=False)
        if len(bad) > SHOWN_BAD:
            console.print(f"... and {len(bad) - SHOWN_BAD} more", markup=False)
        if wrong_url:
            console.print(f"hint: {wrong_url}", markup=False, highlight=False, soft_wrap=True)
        if delete_bad:
            console.print(f"removed {removed} of {len(to_remove)} damaged objects", markup=False)
            if kept:
                console.print(f"kept {kept}: written since the scan, intact when read again, or unreadable "
                              "now", markup=False)
        if any(status in ("corrupt", "foreign") for _, status, _ in bad):
            raise typer.Exit(1)


def _print_prefixes(console: Any, by_prefix: dict[str, Counter[str]]) -> None:
    """Objects by the prefix they verify under, when any verify below the URL."""
    if set(by_prefix) <= {""}:
        return
    console.print("by prefix (names are checked relative to the tier's root):", markup=False)
    for prefix, counts in sorted(by_prefix.items()):
        shown = ", ".join(f"{counts[status]} {status}" for status in STATUSES if counts[status])
        console.print(f"  {prefix + '/' if prefix else '(the URL itself)'}: {shown}", markup=False,
                      highlight=False)
