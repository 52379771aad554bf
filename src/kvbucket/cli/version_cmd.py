"""``kvbucket version``."""

from __future__ import annotations

import typer

import kvbucket


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version() -> None:
        """Print kvbucket's version."""
        typer.echo(kvbucket.__version__)
