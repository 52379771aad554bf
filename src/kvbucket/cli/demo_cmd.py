"""``kvbucket demo``: time to first token saved by a prefix computed on another machine."""

from __future__ import annotations

import importlib.util
import os

import typer


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        target: str = typer.Option(
            None,
            "--target",
            help="Shared tier instead of the in-process Hub emulator: hf://buckets/<ns>/<bucket>[/<prefix>], "
            "s3://<bucket>[/<prefix>] or a directory. Credentials come from the usual environment "
            "(HF_TOKEN, AWS_*). The demo's chunks are removed from it at the end unless --keep.",
        ),
        prompt_tokens: int = typer.Option(
            4096, "--prompt-tokens", min=256, help="Length of the shared document."
        ),
        new_tokens: int = typer.Option(16, "--new-tokens", min=1, help="Tokens each answer generates."),
        dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
        keep: bool = typer.Option(False, "--keep", help="Leave the demo's chunks in --target."),
        size: str = typer.Option(
            None, "--size", hidden=True, help="Model size (tests use 'tiny'); default $KVBUCKET_DEMO_SIZE."
        ),
    ) -> None:
        """Machine A answers a 4,096-token prompt and stores its KV; machine B (a fresh process, empty
        local tiers) answers the same document with another question, with and without the cache."""
        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            raise typer.BadParameter(
                f"the demo needs {' and '.join(missing)}: pip install 'kvbucket[transformers]'"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise typer.BadParameter(
                f"{dtype!r} is not one of float32, bfloat16, float16", param_hint="--dtype"
            )
        from kvbucket.demo.real_model import DemoError, run_demo

        if target is not None and "://" not in target:
            target = os.path.abspath(target)
        try:
            code = run_demo(
                target=target, size=size, prompt_tokens=prompt_tokens, new_tokens=new_tokens, dtype=dtype,
                keep=keep,
            )
        except DemoError as e:
            typer.echo(f"kvbucket demo failed: {e}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(code)
