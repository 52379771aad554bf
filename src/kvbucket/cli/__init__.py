"""The ``kvbucket`` command line (typer). Each command group lives in its own module.

A module in ``COMMAND_MODULES`` exposes ``register(app: typer.Typer) -> None``.

Two properties hold for every command, present and future, because they are enforced here
rather than in each command:

- help texts are plain text, never Rich markup: ``hf://buckets/<ns>/<bucket>[/prefix]`` is
  shown as written instead of crashing ``--help`` (:func:`plain_help`);
- an error reaches the user as one ``error: ...`` line on stderr with exit status 2 (bad
  input) or 1 (a runtime failure), never as a traceback, unless ``--debug`` or
  ``KVBUCKET_LOG_LEVEL=DEBUG`` asks for it (:func:`main`).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Sequence

import typer

COMMAND_MODULES: list[str] = [
    "kvbucket.cli.version_cmd",
    "kvbucket.cli.stats_cmd",
    "kvbucket.cli.demo_cmd",
    "kvbucket.cli.store_cmd",
    "kvbucket.cli.verify_cmd",
    "kvbucket.cli.migrate_cmd",
    "kvbucket.cli.compile_cache_cmd",
    "kvbucket.cli.emulator_cmd",
    "kvbucket.cli.doctor_cmd",
]

LOG_LEVEL_ENV = "KVBUCKET_LOG_LEVEL"


def _click_class(name: str) -> type[Exception]:
    """A click exception class of the click that typer runs on (typer vendors its own copy)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_UsageError = _click_class("UsageError")
_ClickException = _click_class("ClickException")

app = typer.Typer(
    name="kvbucket",
    help="Keep LLM inference caches (KV chunks, compiled artifacts) in buckets and S3.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # sub-commands inherit it (click)
    rich_markup_mode=None,
    pretty_exceptions_enable=False,  # main() turns errors into one line; --debug shows the traceback
    pretty_exceptions_show_locals=False,  # locals may hold tokens
)

_registered = False
_debug = False


def debug_enabled() -> bool:
    """True when the user asked for tracebacks (``--debug`` or ``KVBUCKET_LOG_LEVEL=DEBUG``)."""
    return _debug or os.environ.get(LOG_LEVEL_ENV, "").strip().upper() == "DEBUG"


def _version_callback(value: bool) -> None:
    if value:
        import kvbucket

        typer.echo(f"kvbucket {kvbucket.__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version_callback, is_eager=True,
        help="Print kvbucket's version and exit.",
    ),
    debug: bool = typer.Option(
        False, "--debug", help=f"Log at DEBUG and show tracebacks on errors (or ${LOG_LEVEL_ENV}=DEBUG)."
    ),
) -> None:
    """Keep LLM inference caches (KV chunks, compiled artifacts) in buckets and S3."""
    global _debug
    _debug = _debug or debug
    level = "DEBUG" if debug else os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    if level:
        logging.basicConfig(level=getattr(logging, level, logging.WARNING),
                            format="%(levelname)s %(name)s: %(message)s")


def plain_help(typer_app: typer.Typer) -> None:
    """Render every help text of ``typer_app`` and its sub-apps as plain text (no Rich markup).

    Help texts quote URLs such as ``s3://bucket[/prefix]``, which Rich markup reads as a closing
    tag and refuses with a MarkupError; plain text cannot be misread.
    """
    typer_app.rich_markup_mode = None
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            plain_help(group.typer_instance)


def build_app() -> typer.Typer:
    global _registered
    if not _registered:
        for name in COMMAND_MODULES:
            importlib.import_module(name).register(app)
        plain_help(app)
        _registered = True
    return app


def full_summaries(command: object) -> None:
    """Give every sub-command its whole first sentence as the summary ``kvbucket -h`` lists (click
    would cut it at ~45 characters with "...", in a pipe too); the lines wrap instead."""
    for sub in (getattr(command, "commands", None) or {}).values():
        if sub.short_help is None and sub.help:
            para = " ".join(sub.help.split("\n\n", 1)[0].split())
            end = para.find(". ")
            sub.short_help = para[: end + 1] if end >= 0 else para
        full_summaries(sub)


def _one_line(text: str) -> str:
    """An error message as one line, every secret in it redacted."""
    from kvbucket.secrets import redact

    return redact(" ".join(text.split()))


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: run the command; every failure becomes one line and an exit status."""
    from kvbucket.cli.common import mark_command_start, process_started

    # --timeout counts from the process's start when run as the console script (argv None)
    mark_command_start(process_started() if argv is None else time.monotonic())
    from kvbucket.env_vars import may_be_unknown, warn_unknown

    if may_be_unknown():  # else no variable to warn about, and no engine config (pydantic) to import
        from kvbucket.engine_config import EngineConfig

        warn_unknown(None, EngineConfig.model_fields, lambda line: typer.echo(f"warning: {line}", err=True))
    command = typer.main.get_command(build_app())
    full_summaries(command)
    try:
        rv = command.main(args=list(argv) if argv is not None else None, prog_name="kvbucket",
                          standalone_mode=False)
    except _UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `kvbucket` alone: the help text is the message
            e.show()  # type: ignore[attr-defined]
        else:
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            text = _one_line(e.format_message())  # type: ignore[attr-defined]
            choice = _choice_hint(text)
            if not choice and (choice := _hf_option_hint(text, ctx)):  # click's guesses are beside the point
                text = re.sub(r" \(Possible options: [^)]*\)", "", text)
            typer.echo(f"error: {text.rstrip('.') if choice else text}{choice}{hint}", err=True)
        sys.exit(e.exit_code)  # type: ignore[attr-defined]
    except _ClickException as e:
        typer.echo(f"error: {_one_line(e.format_message())}", err=True)  # type: ignore[attr-defined]
        sys.exit(e.exit_code)  # type: ignore[attr-defined]
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except Exception as e:
        if debug_enabled():
            raise
        sys.exit(_report(e))
    sys.exit(rv if isinstance(rv, int) else 0)


_TOKEN_HINT = ("; kvbucket takes no --token: it reads $HF_TOKEN or the saved `hf auth login` (S3: the AWS_* "
               "variables or profile), so set HF_TOKEN=... for one command")
#: options of `hf buckets` (and habits) kvbucket does not take: what to do instead
HF_OPTION_HINTS: dict[tuple[str, str], str] = {
    ("ls", "-R"): "; `kvbucket ls` is always recursive (every object under the URL): drop -R",
    ("ls", "--recursive"): "; `kvbucket ls` is always recursive (every object under the URL): drop "
                           "--recursive",
    ("ls", "--human-readable"): "; `kvbucket ls` prints sizes in bytes, for scripts; `kvbucket du` adds "
                                "binary units (KiB, MiB, GiB)",
    ("ls", "--tree"): "; `kvbucket ls` prints one name per line (--prefix P narrows it)",
    ("du", "-q"): "; `kvbucket du` prints one summary line (and a fleet's and identities' lines); "
                  "--format json for scripts",
    ("du", "--quiet"): "; `kvbucket du` prints one summary line (and a fleet's and identities' lines); "
                       "--format json for scripts",
    ("du", "--human-readable"): "; `kvbucket du` always shows binary units next to the bytes",
    ("rm", "-r"): "; `kvbucket rm` removes named objects; for everything under a prefix: --prefix P "
                  "(it needs --yes to remove; --dry-run shows what it would remove)",
    ("rm", "-R"): "; `kvbucket rm` removes named objects; for everything under a prefix: --prefix P "
                  "(it needs --yes to remove; --dry-run shows what it would remove)",
    ("rm", "--recursive"): "; `kvbucket rm` removes named objects; for everything under a prefix: "
                           "--prefix P (it needs --yes to remove; --dry-run shows what it would "
                           "remove)",
    ("", "--token"): _TOKEN_HINT,
}
_NO_SUCH_OPTION = re.compile(r"^No such option: (\S+)")


def _hf_option_hint(text: str, ctx: object) -> str:
    """For an option ``hf`` takes and kvbucket does not: what to do instead ("" otherwise)."""
    m = _NO_SUCH_OPTION.match(text)
    if m is None:
        return ""
    command = str(getattr(ctx, "command_path", "")).removeprefix("kvbucket").strip()
    option = m.group(1).split("=", 1)[0]
    return HF_OPTION_HINTS.get((command, option)) or HF_OPTION_HINTS.get(("", option), "")


_MACHINE = "--json (the same as --format json: one JSON document with stable field names)"
#: values of `hf`'s options that kvbucket's same-named options do not take: what to use instead
HF_VALUE_HINTS: dict[tuple[str, str], str] = {
    ("--format", "agent"): f"; kvbucket has no agent format: its machine output, for scripts and agents, is "
                           f"{_MACHINE}",
    ("--format", "auto"): f"; kvbucket does not pick a format by itself: table (the default) is for people, "
                          f"{_MACHINE} for scripts and agents",
    ("--format", "human"): "; kvbucket's format for people is table, the default: drop --format",
}
_NOT_ONE_OF = re.compile(r"'([^']*)' is not one of (.+?)\.?$")
_INVALID_VALUE = re.compile(r"^Invalid value for '([^']+)'")


def _choice_hint(text: str) -> str:
    """For a value that is not one of an option's choices: what to use for a value ``hf`` takes
    (``--format agent``), else the closest choice, if one is close."""
    from kvbucket.did_you_mean import closest

    m = _NOT_ONE_OF.search(text)
    if m is None:
        return ""
    option = _INVALID_VALUE.match(text)
    names = option.group(1).split("/") if option else []
    hf = next((h for n in names if (h := HF_VALUE_HINTS.get((n.strip(), m.group(1).lower())))), None)
    if hf is not None:
        return hf
    close = closest(m.group(1), [c.strip().strip("'\"") for c in m.group(2).split(",")])
    return f"; did you mean {close!r}?" if close else ""


def _report(e: Exception) -> int:
    """One line for an error no command turned into a message; the exit status for it."""
    from kvbucket.errors import ConfigError, InvalidKeyError, KVBucketError

    if isinstance(e, KVBucketError):
        typer.echo(f"error: {_one_line(str(e))}", err=True)
        return 2 if isinstance(e, ConfigError | InvalidKeyError) else 1
    if isinstance(e, OSError) and e.strerror:
        from kvbucket.cli.common import error_text, exit_code_for

        typer.echo(f"error: {_one_line(error_text(e))}", err=True)
        return exit_code_for(e)
    typer.echo(
        f"error: unexpected {type(e).__name__}: {_one_line(str(e))} (a kvbucket bug: rerun with --debug "
        "and report the traceback)",
        err=True,
    )
    return 1


__all__ = ["app", "build_app", "debug_enabled", "main", "plain_help"]
