"""The ``kvbucket`` command line (typer). Each command group lives in its own module.

A module in ``COMMAND_MODULES`` exposes ``register(app: typer.Typer) -> None``.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES: list[str] = [
    "kvbucket.cli.version_cmd",
    "kvbucket.cli.stats_cmd",
    "kvbucket.cli.demo_cmd",
    "kvbucket.cli.store_cmd",
    "kvbucket.cli.verify_cmd",
    "kvbucket.cli.compile_cache_cmd",
    "kvbucket.cli.emulator_cmd",
]

app = typer.Typer(
    name="kvbucket",
    help="Keep LLM inference caches (KV chunks, compiled artifacts) in buckets and S3.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold tokens
)

_registered = False


@app.callback()
def _root() -> None:
    """Keep LLM inference caches (KV chunks, compiled artifacts) in buckets and S3."""


def build_app() -> typer.Typer:
    global _registered
    if not _registered:
        for name in COMMAND_MODULES:
            importlib.import_module(name).register(app)
        _registered = True
    return app


def main() -> None:
    build_app()(prog_name="kvbucket")


__all__ = ["app", "build_app", "main"]
