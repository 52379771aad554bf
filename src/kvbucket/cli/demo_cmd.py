"""``kvbucket demo``: model-shaped KV chunks through the hybrid stack (logic in kvbucket.demo.synthetic)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        target: str = typer.Option(
            None, "--target",
            help="Remote store to use instead of the embedded FileStore in a temp dir: file:///dir, a path, "
            "hf://buckets/<ns>/<bucket>/<optional prefix> or s3://<bucket>/<optional prefix>. The demo's "
            "chunks are removed from it afterwards unless --keep.",
        ),
        chunks: int = typer.Option(32, "--chunks", min=1, help="How many 256-token chunks to store."),
        model: str = typer.Option("llama-3.2-1b", "--model", help="KV layout: qwen2.5-0.5b, llama-3.2-1b, "
                                  "llama-3.1-8b."),
        config: str = typer.Option(None, "--config", help="Engine config (YAML/JSON) whose remote settings "
                                   "(remote_url, remote_storage_plugins, extra_config) to use."),
        keep: bool = typer.Option(False, "--keep", help="Leave the demo's chunks in --target."),
    ) -> None:
        """Store and reload a model-shaped set of KV chunks through local_cpu -> local_disk -> remote,
        verifying every byte. Exits 1 if any byte differs, 2 if the demo cannot run."""
        from kvbucket.demo.synthetic import DemoError, run_synthetic_demo
        from kvbucket.errors import KVBucketError

        try:
            report = run_synthetic_demo(target=target, chunks=chunks, model=model, keep=keep,
                                        config_path=config)
        except (DemoError, KVBucketError) as e:
            typer.echo(f"kvbucket demo failed: {e}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(0 if report.ok else 1)
