"""docs/library.md's table of where each surface takes the store URL (issue 31 item 16): every
name it gives is the name that surface really takes, so the table cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[2]


def table() -> list[list[str]]:
    text = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    section = text.split("## Where the cache lives", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    return [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[1:]]


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_table_covers_every_surface() -> None:
    rows = table()
    takes = " ".join(r[1] for r in rows)
    for name in ("URL", "--target", "open_store", "remote_url", "bucket_handle", "s3_endpoint", "base_path",
                 "store_url"):
        assert name in takes, name
    assert len(rows) >= 10


def test_each_name_is_what_its_surface_takes() -> None:
    from kvbucket.cli import build_app
    from kvbucket.engine_config import EngineConfig
    from kvbucket.integrations.engine_settings import EngineTierSettings
    from kvbucket.l2.config import FsL2Config, HFBucketL2Config, S3L2Config

    fields = {
        "remote_url": EngineConfig, "s3_endpoint": S3L2Config, "base_path": FsL2Config,
        "bucket_handle": HFBucketL2Config, "store_url": EngineTierSettings,
        "store_options": EngineTierSettings,
    }
    options: set[str] = set()
    command = typer.main.get_command(build_app())

    def walk(cmd: object) -> None:
        for p in getattr(cmd, "params", []):
            options.update(p.opts)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(command)
    checked = 0
    for row in table():
        for name in names(row[1]) + names(row[2]):
            key = name.split(".")[-1].split(" ")[0]
            if key in fields:
                assert key in fields[key].model_fields, (row[0], key)
                checked += 1
            elif key.startswith("--"):
                assert key in options, (row[0], key)
                checked += 1
    assert checked >= 8
    from kvbucket.stores import open_store

    assert "url" in open_store.__code__.co_varnames
