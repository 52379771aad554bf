"""How commands report: ``--format table|json`` (``--json`` the same as ``--format json``), and
consoles whose tables are never cut when the output is not a terminal.

JSON goes to stdout as one document (``json.dumps``, compact, as ``hf --format json`` prints
it); field names are snake_case and stable (docs/cli.md lists them). Progress and errors go to
stderr, so ``kvbucket du alice/kv --format json | jq`` reads the document alone.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer

if TYPE_CHECKING:  # rich is imported where a report is drawn: `kvbucket --help` starts without it
    from rich.console import Console
    from rich.table import Table

#: the width of a console that is not a terminal: wide enough that no cell or line is cut
UNCUT_WIDTH = 100_000


class Format(StrEnum):
    """What a reporting command prints."""

    table = "table"
    json = "json"


class ListFormat(StrEnum):
    """``ls`` also has ``quiet``: names (or keys) alone, one per line, like ``hf --format quiet``."""

    table = "table"
    json = "json"
    quiet = "quiet"


FormatOpt = Annotated[Format, typer.Option(
    "--format", case_sensitive=False, help="table (for people) or json (one document with stable field "
    "names, for scripts).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="The same as --format json.")]


def wants_json(fmt: Format | ListFormat | str, as_json: bool = False) -> bool:
    return as_json or str(getattr(fmt, "value", fmt)) == "json"


def _jsonable(x: Any) -> Any:
    if isinstance(x, set | frozenset):
        return sorted(x)
    if isinstance(x, Enum):
        return x.value
    return str(x)


def to_json(data: Any) -> str:
    """One compact JSON document (sets as sorted lists; anything else unknown as its str)."""
    return json.dumps(data, default=_jsonable)


def print_json(data: Any) -> None:
    typer.echo(to_json(data))


def stream_json_array(items: Iterable[Any], out: TextIO | None = None) -> int:
    """Print ``items`` as one JSON array, one element per line, as they come (a listing can be
    long: nothing is held). Returns how many were printed."""
    out = out or sys.stdout
    n = 0
    for item in items:
        out.write(("[" if n == 0 else ",\n ") + to_json(item))
        n += 1
    out.write("]\n" if n else "[]\n")
    out.flush()
    return n


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def console(stderr: bool = False) -> Console:
    """A rich console for a command's report. On a terminal it fits the window; anywhere else (a
    pipe, a file, a CI log) it is wide enough that no table cell or line is cut or wrapped,
    whatever ``$COLUMNS`` says: a log keeps every store name whole."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if is_terminal(stream):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNCUT_WIDTH, soft_wrap=True)


def table(*columns: tuple[str, str], title: str | None = None) -> Table:
    """A table whose cells wrap (fold) on a narrow terminal instead of ending in an ellipsis."""
    from rich.table import Table

    t = Table(title=title)
    for name, justify in columns:
        t.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    return t


__all__ = ["UNCUT_WIDTH", "Format", "FormatOpt", "JsonOpt", "ListFormat", "console", "is_terminal",
           "print_json", "stream_json_array", "table", "to_json", "wants_json"]
