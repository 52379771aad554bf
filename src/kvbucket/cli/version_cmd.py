"""``kvbucket version``."""

from __future__ import annotations

import typer

import kvbucket


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version() -> None:
        """Print kvbucket's version (the same line as `kvbucket --version`)."""
        typer.echo(f"kvbucket {kvbucket.__version__}")
