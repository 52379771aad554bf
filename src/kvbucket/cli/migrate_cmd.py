"""``kvbucket migrate URL``: rewrite the LMCache-format chunks in a store as sealed kvbucket chunks.

The work is :mod:`kvbucket.l2.migrate` (resumable: run it again after an interruption). Exit
status 1 when any object could not be migrated (each is listed), 2 for unusable input.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvbucket.cli import output
from kvbucket.cli.common import DEFAULT_TIMEOUT_S, TimeoutOpt, fail, opened_store, store_url
from kvbucket.cli.store_cmd import human_size
from kvbucket.errors import KVBucketError

SHOWN_FAILED = 20


def _style_of(url: str) -> str:
    if url.startswith("hf://"):
        return "hfbucket"
    if url.startswith("s3://"):
        return "s3"
    return "fs"


def register(app: typer.Typer) -> None:
    @app.command("migrate")
    def migrate_cmd(
        url: str = typer.Argument(
            ...,
            help="Store URL LMCache's adapter wrote to (file:///dir, a path, hf://buckets/NS/NAME/PREFIX, "
            "s3://BUCKET/PREFIX): the same URL kvbucket's adapter is given (its bucket_handle, "
            "base_path or s3_endpoint), since sealed chunks bind their names relative to it. A bucket "
            "id NS/NAME[/PREFIX] is hf://buckets/NS/NAME[/PREFIX].",
            callback=store_url, metavar="URL",
        ),
        source: str = typer.Option(
            None, "--from",
            help="Which LMCache writer's names to migrate: hfbucket, s3 or fs (default: from the URL: "
            "hf:// hfbucket, s3:// s3, otherwise fs).",
        ),
        connector: bool = typer.Option(
            False, "--connector",
            help="Migrate the non-MP connector's objects (LMCache's remote backend, read by "
            "KVBucketConnector) instead of the MP adapter's.",
        ),
        keep_source: bool = typer.Option(
            False, "--keep-source", help="Keep the LMCache-format objects (LMCache nodes still read them)."
        ),
        dry_run: bool = typer.Option(False, "--dry-run", help="Only count what would be migrated."),
        keyring_file: Path = typer.Option(
            None, "--keyring-file",
            help="Keyring JSON: seal the chunks encrypted, as an adapter with this keyring writes them.",
        ),
        timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Rewrite LMCache-format chunks as sealed kvbucket chunks (resumable; exit 1 if any failed)."""
        # imported here, not at the top: every `kvbucket` start (`--help` too) imports this module
        from kvbucket.encryption import Keyring
        from kvbucket.l2.migrate import migrate, plan
        from kvbucket.l2.naming import CONNECTOR_STYLES, MP_STYLES, Naming
        from kvbucket.progress import Progress

        style = source or _style_of(url)
        styles = CONNECTOR_STYLES if connector else MP_STYLES
        if style not in styles:
            kind = "non-MP connector" if connector else "MP adapter"
            raise fail(f"--from {style!r}: LMCache's {kind} formats are {', '.join(sorted(styles))}")
        try:
            keyring = Keyring.from_file(keyring_file) if keyring_file is not None else None
        except KVBucketError as e:
            raise fail(str(e)) from None
        naming = Naming(style=style, connector=connector)
        console = output.console()
        with opened_store(url, timeout) as store:
            moves = plan(store, naming)
            total = sum(m.size for m in moves)
            console.print(f"{len(moves)} LMCache-format objects ({human_size(total)}) in {store.url}",
                          markup=False, highlight=False)  # fmt: skip
            if dry_run or not moves:
                return
            with Progress("migrating", total=total) as progress:
                report = migrate(store, naming, moves, tier="connector" if connector else "l2",
                                 encryption=keyring, keep_source=keep_source,
                                 progress=progress.advance)  # fmt: skip
        console.print(
            f"wrote {report.written} sealed chunks ({human_size(report.written_bytes)}), "
            f"{report.already} were already there; removed {report.deleted} LMCache-format objects",
            markup=False, highlight=False,
        )  # fmt: skip
        for name, reason in report.failed[:SHOWN_FAILED]:
            console.print(f"failed: {name}: {reason}", markup=False, highlight=False)
        if len(report.failed) > SHOWN_FAILED:
            console.print(f"... and {len(report.failed) - SHOWN_FAILED} more", markup=False)
        if report.failed:
            console.print("run the same command again to retry them", markup=False)
            raise typer.Exit(1)
