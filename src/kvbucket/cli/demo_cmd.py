"""``kvbucket demo``: the real-model prefix-reuse demo (default) or, with ``--synthetic``, model-shaped
KV chunks through the tier stack (logic in kvbucket.demo.real_model and kvbucket.demo.synthetic)."""

from __future__ import annotations

import importlib.util
import os

import typer

from kvbucket.cli import output
from kvbucket.cli.common import (
    DEFAULT_TIMEOUT_S,
    FirstAnswerTimeoutOpt,
    fail,
    is_remote,
    opened_store,
    store_url,
)
from kvbucket.errors import ConfigError
from kvbucket.secrets import redact
from kvbucket.stores import store_scheme

_DTYPES = ("float32", "bfloat16", "float16")


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        synthetic: bool = typer.Option(
            False, "--synthetic",
            help="Run the synthetic demo instead: model-shaped KV chunks stored and re-read through "
            "local_cpu -> local_disk -> remote, every byte verified (no torch needed).",
        ),
        target: str = typer.Option(
            None, "--target",
            help="Shared tier instead of the default (the real-model demo: an in-process Hub emulator "
            "with a private bucket; --synthetic: a FileStore in a temp dir): "
            "hf://buckets/<ns>/<bucket>/<prefix>, s3://<bucket>/<prefix> (prefixes optional), file:///dir "
            "or a path; a bucket id <ns>/<bucket>[/<prefix>] is hf://buckets/<ns>/<bucket>[/<prefix>]. "
            "Credentials come from the usual environment (HF_TOKEN, AWS_*). The demo's chunks are "
            "removed from it at the end unless --keep.",
            callback=store_url,
        ),
        keep: bool = typer.Option(False, "--keep", help="Leave the demo's chunks in --target."),
        prompt_tokens: int = typer.Option(
            4096, "--prompt-tokens", min=256, help="Real-model demo: length of the shared document."
        ),
        new_tokens: int = typer.Option(
            16, "--new-tokens", min=1, help="Real-model demo: tokens per answer."
        ),
        dtype: str = typer.Option(
            "float32", "--dtype", help="Real-model demo: float32, bfloat16 or float16."
        ),
        size: str = typer.Option(
            None, "--size", hidden=True, help="Model size (tests use 'tiny'); default $KVBUCKET_DEMO_SIZE."
        ),
        chunks: int = typer.Option(
            None, "--chunks", min=1, help="--synthetic: 256-token chunks to store (32)."
        ),
        model: str = typer.Option(
            None, "--model",
            help="--synthetic: KV layout: qwen2.5-0.5b, llama-3.2-1b (default), llama-3.1-8b.",
        ),
        config: str = typer.Option(
            None, "--config",
            help="--synthetic: engine config (YAML/JSON) whose remote settings (remote_url, "
            "remote_storage_plugins, extra_config) to use, with the KVBUCKET_* variables applied as an "
            "engine applies them (KVBUCKET_REMOTE_URL wins over the file); --target wins over both.",
        ),
        latency_ms: float = typer.Option(
            0.0, "--latency-ms", min=0,
            help="Real-model demo on the in-process Hub emulator: add this many milliseconds to every "
            "request machine B makes (a Hub round trip across regions costs about 50), to see the "
            "time to first token of a cross-machine hit at that latency.",
        ),
        timeout: FirstAnswerTimeoutOpt = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Time to first token saved by a prompt prefix computed on another machine.

        Machine A answers a 4,096-token prompt with a ~0.5B-shaped Llama (random weights) and stores its KV.

        Machine B (a fresh process, empty local tiers) asks another question, with and without the cache.

        Exits 1 if outputs (or, with --synthetic, bytes) differ, 2 if the demo cannot run.
        """
        if target is not None:
            try:
                store_scheme(target)  # a URL no store opens is refused at once, by either demo
            except ConfigError as e:
                raise fail(str(e)) from None
        if latency_ms and target is not None:
            raise typer.BadParameter("adds latency on the in-process Hub emulator, so it does not go with "
                                     "--target (a real bucket has its own)", param_hint="--latency-ms")
        if target is not None and is_remote(target):
            _check_target(target, timeout)
        implied = [flag for flag, v in (("--chunks", chunks), ("--model", model), ("--config", config)) if v]
        if synthetic or implied:  # those flags only exist for the synthetic demo: they imply it
            real_only = [
                flag for flag, v, default in (
                    ("--prompt-tokens", prompt_tokens, 4096), ("--new-tokens", new_tokens, 16),
                    ("--dtype", dtype, "float32"), ("--size", size, None), ("--latency-ms", latency_ms, 0.0),
                ) if v != default
            ]
            if real_only:
                raise typer.BadParameter(
                    f"{', '.join(real_only)} belong(s) to the real-model demo, not the synthetic one "
                    f"(selected by {'--synthetic' if synthetic else ', '.join(implied)})"
                )
            _synthetic(target, keep, chunks, model, config)
            return
        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            raise typer.BadParameter(
                f"the real-model demo needs {' and '.join(missing)}: pip install 'kvbucket[transformers]' "
                "(or run `kvbucket demo --synthetic`, which does not)"
            )
        if dtype not in _DTYPES:
            raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(_DTYPES)}", param_hint="--dtype")
        from kvbucket.demo.real_model import DemoError, run_demo

        if target is not None and "://" not in target:
            target = os.path.abspath(target)
        try:
            code = run_demo(
                target=target, size=size, prompt_tokens=prompt_tokens, new_tokens=new_tokens, dtype=dtype,
                keep=keep, latency_ms=latency_ms, console=output.console(),
            )
        except DemoError as e:
            from kvbucket.cli import debug_enabled

            if debug_enabled() and e.log_tail:
                typer.echo(redact(e.log_tail), err=True)
            raise fail(f"kvbucket demo failed: {e}") from None
        raise typer.Exit(code)


def _check_target(target: str, timeout: float) -> None:
    """A remote --target must exist and answer before the demo starts: one line if not, not one per chunk."""
    with opened_store(target, timeout, whole=False):
        pass


def _synthetic(
    target: str | None, keep: bool, chunks: int | None, model: str | None, config: str | None
) -> None:
    from kvbucket.demo.synthetic import DEFAULT_MODEL, DemoError, run_synthetic_demo
    from kvbucket.errors import KVBucketError

    try:
        report = run_synthetic_demo(
            target=target, chunks=chunks or 32, model=model or DEFAULT_MODEL, keep=keep, config_path=config,
            console=output.console(),
        )
    except (DemoError, KVBucketError) as e:
        raise fail(f"kvbucket demo failed: {e}") from None
    raise typer.Exit(0 if report.ok else 1)
