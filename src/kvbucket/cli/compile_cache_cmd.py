"""``kvbucket compile-cache``: create/set a target, fetch, sync, lookup, status, cleanup."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from kvbucket.cli import output
from kvbucket.cli.common import (
    DEFAULT_TIMEOUT_S,
    FirstAnswerTimeoutOpt,
    NoAnswerError,
    bounded,
    error_text,
    exit_code_for,
    exit_now,
    first_answer_deadline,
    is_remote,
    open_for_command,
    probe_or_exit,
    store_url,
    unreachable_hint,
)
from kvbucket.cli.output import Format, FormatOpt, JsonOpt, wants_json
from kvbucket.errors import ConfigError, KVBucketError
from kvbucket.secrets import redact

app = typer.Typer(
    name="compile-cache",
    help="Share compiled artifacts (Neuron NEFFs, torch.compile, Triton/JAX/vLLM dirs) through a bucket.",
    no_args_is_help=True,
)

_TARGET_HELP = ("hf://buckets/ns/name[/prefix] (or the bucket id ns/name[/prefix]), s3://bucket[/prefix] or "
                "a directory (default: the one `set` remembered).")
TargetOpt = Annotated[str | None, typer.Option("--target", "-t", help=_TARGET_HELP, callback=store_url)]
CacheDirOpt = Annotated[Path | None, typer.Option("--cache-dir", help="Local cache dir (neuron: resolved as "
                                                  "Neuron does; torch: ~/.cache/kvbucket/torch-compile).")]
LayoutOpt = Annotated[str, typer.Option("--layout", help="neuron, torch or directory (directory:NAME[:DEPTH] "
                                        "names the version and the entry depth, e.g. directory:inductor:2).")]
VersionOpt = Annotated[str | None, typer.Option("--compiler-version", help="Compiler version (neuron: "
                                                "2.15.128.0+56dc5a86; default: the installed neuronx-cc).")]


@contextmanager
def _errors() -> Iterator[None]:
    """Turn kvbucket errors into a one-line message and an exit code (kvbucket.cli.common)."""
    try:
        yield
    except (KVBucketError, OSError) as e:
        # one line, never wrapped, secrets redacted
        typer.secho(f"error: {redact(' '.join(error_text(e).split()))}", fg="red", err=True)
        raise typer.Exit(exit_code_for(e)) from None


def _layout_and_dir(layout: str, version: str | None, cache_dir: Path | None) -> tuple[Any, Path, str | None]:
    from kvbucket.compile_cache.session import _resolve_dir

    lay = _parse_layout(layout, version)
    root, remote, disabled = _resolve_dir(lay, cache_dir)
    if disabled:
        output.console(stderr=True).print(
            "note: NEURON_CC_FLAGS has --no-cache; the compiler will not use this cache")
    return lay, root, remote


def _parse_layout(layout: str, version: str | None) -> Any:
    from kvbucket.compile_cache.layout import get_layout

    name, _, rest = layout.partition(":")
    if name != "directory" or not rest:
        return get_layout(layout, version=version)
    group, _, depth = rest.partition(":")
    try:
        d = int(depth) if depth else 1
    except ValueError:
        raise ConfigError(f"--layout {layout!r}: the depth must be a number, e.g. directory:inductor:2"
                          ) from None
    return get_layout("directory", version=group or version, depth=d)


def _target(explicit: str | None, neuron_remote: str | None) -> str:
    from kvbucket.compile_cache.settings import resolve_target

    t = resolve_target(explicit, neuron_remote)
    if t is None:
        raise ConfigError("no compile cache target: pass --target, set $KVBUCKET_COMPILE_CACHE, or run "
                          "`kvbucket compile-cache set hf://buckets/<namespace>/<bucket>`")
    return t


def _open(target: str, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Open the target; a remote one must answer a first listing within ``timeout`` seconds."""
    from kvbucket.compile_cache.session import hub_offline

    if hub_offline() and target.startswith("hf://"):
        raise ConfigError("HF_HUB_OFFLINE is set: unset it to reach the bucket")
    if not is_remote(target):  # as `set`: a directory must exist (a typo would start an empty cache)
        _existing_dir(target)
    store = open_for_command(target, create=None)
    probe_or_exit(store, target, timeout)
    return store


def _emit(data: Any, as_json: bool, text: str) -> None:
    if as_json:
        output.print_json(data)
    else:
        typer.echo(text)


def _progress() -> bool:
    """Commands report progress: a bar on a terminal, a line every few seconds in a log."""
    return True


@app.command("create")
def create(
    target: Annotated[str, typer.Argument(help="hf://buckets/<ns>/<bucket> (or the bucket id <ns>/<bucket>), "
                                          "s3://<bucket> or a directory.", callback=store_url)],
    public: Annotated[bool, typer.Option("--public", help="Hub only: make the bucket readable by anyone "
                                         "(writes stay yours). Default: private.")] = False,
    remember: Annotated[bool, typer.Option("--set/--no-set", help="Remember it as the default target.")]
    = True,
    timeout: FirstAnswerTimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """Create the cache's bucket (private unless --public) and remember it.

    Hub: creates the bucket with huggingface_hub's create_bucket (exists already: kept as is).
    S3: kvbucket never creates or re-permissions S3 buckets (that is your infrastructure's job,
    and new S3 buckets are private by default); create checks the bucket is reachable and
    writable. A directory is created with mode 0700.
    """
    from kvbucket.compile_cache.settings import check_target, save_target

    with _errors():
        t = check_target(target)
        if t.startswith("hf://buckets/"):
            ns, name = t.removeprefix("hf://buckets/").split("/")[:2]
            where = _create_hub_bucket(f"{ns}/{name}", public, timeout)
            typer.echo(where)
        elif t.startswith("s3://"):
            if public:
                raise ConfigError("--public is for Hub buckets; kvbucket never makes S3 buckets public")
            store = _open(t, timeout)
            try:
                probe_name = ".kvbucket/probe"
                r = store.put_many([(probe_name, b"ok")])[0]
                if not r.ok:
                    raise KVBucketError(f"{t} is not writable: {r.error}")
                store.delete_many([probe_name])
            finally:
                store.close()
            typer.echo(f"{t} is reachable and writable")
        else:
            if public:
                raise ConfigError("--public is for Hub buckets")
            path = Path(t.removeprefix("file://"))
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            typer.echo(f"directory {path} ready")
        if remember:
            p = save_target(t)
            typer.echo(f"default target saved in {p}")


def _create_hub_bucket(bucket_id: str, public: bool, timeout: float) -> str:
    """Create (or keep) a Hub bucket; a line saying where it is. Errors name the token's source."""
    from kvbucket.stores.hub.config import HFBucketConfig, check_hf_endpoint_env

    check_hf_endpoint_env()  # before huggingface_hub's import reads it
    from huggingface_hub import HfApi

    from kvbucket.stores.hub.client import HubBucketClient

    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/{bucket_id}")
    endpoint, token = cfg.resolved_endpoint(), cfg.resolved_token()  # read now, not at import
    # the client maps huggingface_hub's errors to kvbucket's (auth: names where the token came from)
    client = HubBucketClient(endpoint=endpoint, bucket_id=bucket_id, token=token,
                             token_source=cfg.token_source(), max_retries=0)
    api = HfApi(endpoint=endpoint, token=token)
    url = f"hf://buckets/{bucket_id}"

    def create() -> Any:
        api.create_bucket(bucket_id, private=not public, exist_ok=True)
        return api.bucket_info(bucket_id)

    try:
        info = bounded(create, timeout, url, deadline=first_answer_deadline(timeout))
    except NoAnswerError as e:
        exit_now(str(e), 1)
    except Exception as e:
        mapped = client.error(e, "create the bucket")
        mapped.args = (unreachable_hint(mapped, url),)
        raise mapped from None
    private = getattr(info, "private", None)
    if private is not None and private == public:
        output.console(stderr=True).print(
            f"warning: bucket {bucket_id} already existed and is "
            f"{'private' if private else 'PUBLIC'}; its visibility was not changed",
            markup=False, highlight=False)
    vis = "private" if private else "public"
    return f"bucket {bucket_id} ready ({vis}) on {endpoint}: hf://buckets/{bucket_id}"


def _existing_dir(target: str) -> Path:
    path = Path(target.removeprefix("file://")).expanduser()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"{path} {what}; create it first (`kvbucket compile-cache create {path}`) "
                          "or give hf://buckets/<ns>/<bucket> or s3://<bucket>")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    return path


@app.command("set")
def set_target(target: Annotated[str, typer.Argument(help=_TARGET_HELP, callback=store_url)]) -> None:
    """Remember TARGET as the default compile cache (a small file in your config dir).

    A directory must exist (`kvbucket compile-cache create DIR` makes one); bucket URLs are
    remembered as given and reached when used.
    """
    from kvbucket.compile_cache.settings import check_target, save_target

    with _errors():
        t = check_target(target)
        if not is_remote(t):
            _existing_dir(t)
        p = save_target(t)
        typer.echo(f"compile cache target saved in {p}")


@app.command("fetch")
def fetch_cmd(
    model_id: Annotated[str | None, typer.Argument(help="Only this model's entries (default: the whole "
                                                   "flat area of the compiler version).")] = None,
    task: Annotated[str | None, typer.Option("--task")] = None,
    target: TargetOpt = None, cache_dir: CacheDirOpt = None, layout: LayoutOpt = "neuron",
    compiler_version: VersionOpt = None, fmt: FormatOpt = Format.table, as_json: JsonOpt = False,
    timeout: FirstAnswerTimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """Pre-warm the local cache from the bucket (complete entries only, written atomically)."""
    from kvbucket.compile_cache.fetch import fetch
    from kvbucket.compile_cache.transfer import ModelScope

    as_json = wants_json(fmt, as_json)
    with _errors():
        lay, root, remote = _layout_and_dir(layout, compiler_version, cache_dir)
        scope = ModelScope(model_id, task) if model_id else None
        store = _open(_target(target, remote), timeout)
        try:
            rep = fetch(store, lay, root, groups=lay.current_groups(), scope=scope, progress=_progress())
        finally:
            store.close()
        _emit(rep.to_dict(), as_json, rep.summary())
        if rep.failed:
            raise typer.Exit(1)


@app.command("sync")
def sync_cmd(
    target: TargetOpt = None, cache_dir: CacheDirOpt = None, layout: LayoutOpt = "neuron",
    compiler_version: VersionOpt = None, fmt: FormatOpt = Format.table, as_json: JsonOpt = False,
    lock_timeout: Annotated[float, typer.Option("--lock-timeout", help="Seconds to wait for another "
                                                "sync on this host.")] = 600.0,
    timeout: FirstAnswerTimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """Upload every good local entry the bucket lacks (failed, locked and partial ones never)."""
    from kvbucket.compile_cache.sync import sync

    as_json = wants_json(fmt, as_json)
    with _errors():
        lay, root, remote = _layout_and_dir(layout, compiler_version, cache_dir)
        store = _open(_target(target, remote), timeout)
        try:
            rep = sync(store, lay, root, groups=lay.current_groups() if compiler_version else None,
                       progress=_progress(), lock_timeout=lock_timeout)
        finally:
            store.close()
        _emit(rep.to_dict(), as_json, rep.summary())
        if rep.failed:
            raise typer.Exit(1)


@app.command("lookup", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lookup_cmd(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="Hub model id, e.g. meta-llama/Llama-3.1-8B")],
    task: Annotated[str | None, typer.Option("--task")] = None,
    compiler_version: VersionOpt = None,
    target: TargetOpt = None, layout: LayoutOpt = "neuron", fmt: FormatOpt = Format.table,
    as_json: JsonOpt = False,
    timeout: FirstAnswerTimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """Export records of MODEL_ID; extra options filter them: --tensor_parallel_size 2 --dtype bf16.

    Filter names and values are normalized (tp_degree = tensor_parallel_size, bf16 = bfloat16,
    max_model_len = sequence_length, ...), so records written by one front end match another's.
    """
    from rich.table import Table

    from kvbucket.compile_cache.lookup import lookup, parse_filter_args

    as_json = wants_json(fmt, as_json)
    with _errors():
        filters = parse_filter_args(ctx.args)
        lay = _parse_layout(layout, compiler_version)
        groups = lay.current_groups() if compiler_version else None
        group = groups[0] if groups else None
        store = _open(_target(target, None), timeout)
        try:
            recs = lookup(store, model_id, task=task, group=group, filters=filters)
        finally:
            store.close()
        if as_json:
            _emit([r.to_dict() for r in recs], True, "")
            return
        if not recs:
            typer.echo(f"no export records for {model_id} match")
            raise typer.Exit(1)
        table = Table("task", "compiler", "config", title=f"{model_id}: {len(recs)} cached export(s)")
        for r in recs:
            table.add_row(r.task, r.group, " ".join(f"{k}={v}" for k, v in r.config.items()))
        output.console().print(table)


@app.command("status")
def status_cmd(cache_dir: CacheDirOpt = None, layout: LayoutOpt = "neuron",
               compiler_version: VersionOpt = None, fmt: FormatOpt = Format.table,
               as_json: JsonOpt = False) -> None:
    """Local entries per compiler version and state (good, failed, in_progress, incomplete), with bytes."""
    from kvbucket.compile_cache.maintenance import status

    as_json = wants_json(fmt, as_json)
    with _errors():
        lay, root, _ = _layout_and_dir(layout, compiler_version, cache_dir)
        current = lay.current_groups()
        groups = status(lay, root, current)
        if as_json:
            body = {"cache_dir": str(root), "current": current, "groups": [g.to_dict() for g in groups]}
            _emit(body, True, "")
            return
        table = output.table(("version", "left"), *((col, "right") for col in (
            "good", "failed", "in progress", "incomplete", "bytes", "")), title=f"compile cache {root}")
        for g in groups:
            mark = "" if g.current is None else ("current" if g.current else "old")
            table.add_row(g.group, *(str(g.entries.get(s, 0)) for s in ("good", "failed", "in_progress",
                                                                         "incomplete")),
                          f"{sum(g.bytes.values()):,}", mark)
        out = output.console()
        out.print(table)
        if any(g.entries.get("failed") or g.entries.get("in_progress") for g in groups):
            out.print("failed entries and stale locks block recompiling: `kvbucket compile-cache cleanup`")


@app.command("cleanup")
def cleanup_cmd(
    cache_dir: CacheDirOpt = None, layout: LayoutOpt = "neuron", compiler_version: VersionOpt = None,
    old_versions: Annotated[bool, typer.Option("--old-versions", help="Also remove other compiler versions.")]
    = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print what would be removed.")] = False,
    fmt: FormatOpt = Format.table, as_json: JsonOpt = False,
) -> None:
    """Remove failed entries, stale locks, dead compiles (refuses while neuronx-cc runs)."""
    from kvbucket.compile_cache.maintenance import cleanup

    as_json = wants_json(fmt, as_json)
    with _errors():
        lay, root, _ = _layout_and_dir(layout, compiler_version, cache_dir)
        rep = cleanup(lay, root, old_versions=old_versions, current=lay.current_groups(), dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        lines = [f"{verb} {p} ({why})" for p, why in rep.removed] or ["nothing to clean"]
        _emit(rep.to_dict(), as_json, "\n".join([*lines, f"{verb} {rep.bytes:,} bytes"]))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="compile-cache")


__all__ = ["app", "register"]
