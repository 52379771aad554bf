"""``kvbucket demo``: a prompt prefix computed on machine A, reused by machine B.

The parent process holds the shared tier (by default an in-process Hub emulator with a
private bucket; ``--target`` names a real bucket, S3 or a directory instead) and runs two
*machines* as fresh Python processes, one after the other:

- **A** builds a ~0.5B-shaped Llama with seeded random weights, answers a long document plus a
  question, and stores the document's KV chunks (local CPU -> local disk -> remote).
- **B** rebuilds the same model from the seed, with empty local tiers, and answers the same
  document with a *different* question twice: with the cache (the document's chunks come from
  the remote tier) and without it (the plain ``model.generate``). It reports both times to first
  token and whether the greedy outputs are identical.

Machines report progress and results as JSON lines on stdout; the parent draws the progress and
the table. Credentials reach the machines through the environment, never the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbucket.demo.model import SIZES
from kvbucket.secrets import redact

DEMO_NAMESPACE = "demo"
DEMO_BUCKET = "kvbucket-demo"
REMOTE_PREFIX = "kvbucket-demo"
SIZE_ENV = "KVBUCKET_DEMO_SIZE"


@dataclass
class DemoConfig:
    """Everything both machines must agree on (sent to them as JSON)."""

    size: str = "qwen0.5b-like"
    prompt_tokens: int = 4096
    question_tokens: int = 32
    new_tokens: int = 16
    chunk_tokens: int = 256
    dtype: str = "float32"
    seed: int = 0
    salt: str = ""
    store_url: str = ""
    store_options: dict[str, Any] = field(default_factory=dict)
    cleanup: bool = False

    def model_id(self) -> str:
        return f"kvbucket-demo/llama-{self.size}-seed{self.seed}"


def demo_prompts(cfg: DemoConfig, vocab_size: int) -> tuple[list[int], list[int], list[int]]:
    """The shared document and the two questions, as token ids (seeded, so both machines agree).

    A random-weight model has no tokenizer worth using; random ids exercise exactly the same
    attention and MLP work as text would.
    """
    import random

    rng = random.Random(cfg.seed)
    doc = [rng.randrange(vocab_size) for _ in range(cfg.prompt_tokens)]
    qa = [rng.randrange(vocab_size) for _ in range(cfg.question_tokens)]
    qb = [rng.randrange(vocab_size) for _ in range(cfg.question_tokens)]
    return doc, qa, qb


# ---- a machine (runs in its own process) --------------------------------------------------


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _open_remote_store(cfg: DemoConfig) -> Any:
    from kvbucket.metrics import InstrumentedStore
    from kvbucket.stores import open_store

    store = open_store(cfg.store_url, **cfg.store_options)
    scheme = cfg.store_url.partition("://")[0] if "://" in cfg.store_url else "file"
    return InstrumentedStore(store, name=scheme)


def _machine_backend(cfg: DemoConfig, layout: Any, local_dir: Path) -> Any:
    """local_cpu -> local_disk -> remote, each tier instrumented for the table."""
    from kvbucket.backends.hybrid import HybridBackend
    from kvbucket.backends.local_cpu import LocalCPUBackend
    from kvbucket.backends.local_disk import LocalDiskBackend
    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.metrics import InstrumentedBackend

    budget = 4 * 2**30
    tiers = [
        InstrumentedBackend(LocalCPUBackend(budget), "local_cpu"),
        InstrumentedBackend(LocalDiskBackend(local_dir, budget), "local_disk"),
        InstrumentedBackend(
            RemoteBackend(_open_remote_store(cfg), layout.to_kv_layout(), prefix=REMOTE_PREFIX), "remote"
        ),
    ]
    return HybridBackend(tiers)


def _forget_manifest(cfg: DemoConfig, identity: Any) -> None:
    """Remove the identity manifest the demo's remote tier recorded (``_identity/``, beside the
    chunks), so that a cleaned-up target keeps nothing of the demo."""
    from kvbucket.identity.manifest import manifest_name

    if identity is None or not getattr(identity, "token", None):
        return
    store = _open_remote_store(cfg)
    try:
        store.delete_many([manifest_name(REMOTE_PREFIX, identity.model, identity.token)])
    finally:
        store.close()


class _FirstTokenClock:
    """A ``generate()`` streamer noting when the first new token exists (the prompt comes first)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _timed_generate(fn: Any, ids: Any, new_tokens: int) -> tuple[Any, float]:
    from transformers.generation.streamers import BaseStreamer

    clock = _FirstTokenClock()
    streamer = type("FirstTokenStreamer", (BaseStreamer,), {"put": clock.put, "end": clock.end})()
    t0 = time.perf_counter()
    out = fn(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=streamer,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert clock.first is not None, "generate() produced no token"
    return out, clock.first - t0


def run_machine(role: str, cfg: DemoConfig, workdir: Path) -> dict[str, Any]:
    import torch
    from prometheus_client import REGISTRY, generate_latest

    from kvbucket.demo.model import build_model
    from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout
    from kvbucket.metrics import summarize

    dims = SIZES[cfg.size]
    dtype = getattr(torch, cfg.dtype)
    _emit("step", text=f"machine {role.upper()}: building the model (seed {cfg.seed})")
    t = time.perf_counter()
    model = build_model(dims, seed=cfg.seed, dtype=dtype, name=cfg.model_id())
    build_s = time.perf_counter() - t
    doc, qa, qb = demo_prompts(cfg, dims.vocab_size)
    ids = torch.tensor([doc + (qa if role == "a" else qb)])
    with torch.inference_mode():  # one-time kernel and allocator warm-up, outside every timing
        model(ids[:, :64])
    # generate()'s own first call (lazy imports, generation config): up to ~1 s on a cold page
    # cache, paid by the timing that runs first (the cached one) and not by the second
    warm = ids[:, :16]
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=1, do_sample=False)
    local_dir = workdir / f"machine-{role}-disk"
    cache = None
    backend = None
    result: dict[str, Any] = {"role": role, "build_seconds": build_s, "prompt_tokens": ids.shape[1]}
    try:
        layout = probe_kv_layout(model, cfg.chunk_tokens)
        backend = _machine_backend(cfg, layout, local_dir)
        cache = KVBucketPrefixCache(
            model, backend, salt=cfg.salt, chunk_tokens=cfg.chunk_tokens, model_id=cfg.model_id()
        )
        result["chunk_bytes"] = cache.layout.nbytes
        if role == "a":
            _emit("step", text=f"machine A: answering {ids.shape[1]:,} tokens (no cache yet)")
            _, ttft = _timed_generate(cache.generate, ids, cfg.new_tokens)
            result.update(ttft=ttft, hit_tokens=cache.last_stats.hit_tokens)
            _emit("step", text="machine A: storing the document's KV chunks")
            t = time.perf_counter()
            cache.close()
            backend.flush()
            result.update(
                store_seconds=time.perf_counter() - t,
                chunks_stored=cache.store_stats.stored,
                chunks_failed=cache.store_stats.failed + cache.store_stats.dropped,
            )
        else:
            _emit("step", text=f"machine B: answering {ids.shape[1]:,} tokens with the cache")
            hit, ttft_hit = _timed_generate(cache.generate, ids, cfg.new_tokens)
            stats = cache.last_stats
            _emit("step", text=f"machine B: answering {ids.shape[1]:,} tokens without the cache")
            ref, ttft_ref = _timed_generate(model.generate, ids, cfg.new_tokens)
            n = ids.shape[1]
            logit_diff = (hit.logits[0].float() - ref.logits[0].float()).abs().max().item()
            result.update(
                ttft_hit=ttft_hit,
                ttft_ref=ttft_ref,
                hit_tokens=stats.hit_tokens,
                computed_tokens=stats.computed_tokens,
                bytes_loaded=stats.bytes_loaded,
                load_seconds=stats.lookup_seconds + stats.load_seconds,
                identical=hit.sequences[0, n:].tolist() == ref.sequences[0, n:].tolist(),
                output_with=hit.sequences[0, n:].tolist(),
                output_without=ref.sequences[0, n:].tolist(),
                first_logit_max_diff=logit_diff,
            )
            cache.close()
            if cfg.cleanup:
                _emit("step", text="machine B: removing the demo's chunks from the target")
                removed = sum(1 for k in cache.chunk_keys(doc) if backend.remove(k))
                result["removed_chunks"] = removed
                _forget_manifest(cfg, cache.identity)  # the identity's record: its chunks are gone
    finally:
        if cache is not None:
            cache.close()
        if backend is not None:
            backend.close()
        shutil.rmtree(local_dir, ignore_errors=True)
    summary = summarize(generate_latest(REGISTRY).decode())
    result["tiers"] = [asdict(r) for r in summary.rows]
    result["integrity_verified"] = sum(summary.integrity_verified.values())
    result["integrity_failures"] = sum(summary.integrity_failures.values())
    return result


def _machine_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvbucket.demo.real_model")
    p.add_argument("--role", choices=["a", "b"], required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    args = p.parse_args(argv)
    cfg = DemoConfig(**json.loads(args.config.read_text()))
    try:
        result = run_machine(args.role, cfg, args.workdir)
    except Exception as e:  # reported to the parent, which exits non-zero
        _emit("error", text=f"{type(e).__name__}: {e}")
        raise
    _emit("result", **result)
    return 0


# ---- the parent: shared tier, two machines, the table ---------------------------------------


class DemoError(Exception):
    """A machine failed; the message holds its last words, ``log_tail`` the end of its stderr
    (a traceback: the command shows it with ``--debug``)."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _run_machine_process(
    role: str, cfg_path: Path, workdir: Path, env: dict[str, str], on_step: Any
) -> dict[str, Any]:
    log_path = workdir / f"machine-{role}.log"
    home = workdir / f"machine-{role}-hf-home"  # own HF/Xet caches: B must not read A's local copies
    env = {**env, "HF_HOME": str(home), "HF_XET_CACHE": str(home / "xet")}
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    cmd = [sys.executable, "-m", "kvbucket.demo.real_model", "--role", role, "--config", str(cfg_path),
           "--workdir", str(workdir)]
    result: dict[str, Any] | None = None
    error: str | None = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if msg.get("event") == "step":
                    on_step(msg["text"])
                elif msg.get("event") == "result":
                    result = msg
                elif msg.get("event") == "error":
                    error = msg["text"]
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0 or result is None:
        raise DemoError(f"machine {role.upper()} failed (exit {rc}): {error or 'see its log below'}",
                        log_tail=log_path.read_text()[-2000:])
    return result


def run_demo(
    *,
    target: str | None = None,
    size: str | None = None,
    prompt_tokens: int = 4096,
    new_tokens: int = 16,
    dtype: str = "float32",
    keep: bool = False,
    latency_ms: float = 0.0,
    console: Any = None,
) -> int:
    """Run both machines and print the table. Returns the exit code (1 when outputs differ).

    ``latency_ms`` (the in-process emulator only) delays every request machine B makes, through
    the emulator's fault rules: the TTFT of a cross-machine hit at wide-area latency."""
    from rich.console import Console

    from kvbucket.progress import Progress

    console = console or Console()
    size = size or os.environ.get(SIZE_ENV) or "qwen0.5b-like"
    if size not in SIZES:
        raise DemoError(f"unknown demo size {size!r}; choose one of {', '.join(SIZES)}")
    wall0 = time.perf_counter()
    cfg = DemoConfig(
        size=size,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        dtype=dtype,
        salt=f"demo-{secrets.token_hex(8)}",  # a fresh namespace per run: A's stores are B's only hits
        cleanup=target is not None and not keep,
    )
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    workdir = Path(tempfile.mkdtemp(prefix="kvbucket-demo-"))
    os.chmod(workdir, 0o700)
    emulator = None
    try:
        if target is None:
            emulator, token = _start_emulator(console)
            cfg.store_url = f"hf://buckets/{DEMO_NAMESPACE}/{DEMO_BUCKET}"
            env.update(HF_ENDPOINT=emulator.endpoint, HF_TOKEN=token, HF_HUB_DISABLE_TELEMETRY="1")
            where = f"a private bucket {DEMO_NAMESPACE}/{DEMO_BUCKET} on the in-process Hub emulator"
        else:
            cfg.store_url = target
            where = redact(target)
        cfg_path = workdir / "config.json"
        cfg_path.write_text(json.dumps(asdict(cfg)))
        console.print(
            f"kvbucket demo: a {size} Llama (random weights, {dtype}), a {prompt_tokens:,}-token document; "
            f"shared tier: {where}"
        )
        # 3 steps on A, 3 on B (+1 cleanup), then "done": the bar completes only when B has finished.
        # On a terminal a bar; in a log (`make demo > log`) each step as a line, then one every few seconds.
        steps = (7 if cfg.cleanup else 6) + 1
        with Progress("starting", total=steps, unit="steps", console=console) as progress:

            def on_step(text: str) -> None:
                progress.describe(text, advance=1)

            a = _run_machine_process("a", cfg_path, workdir, env, on_step)
            if emulator is not None and latency_ms:
                emulator.faults.add("*", latency_s=latency_ms / 1000)
            b = _run_machine_process("b", cfg_path, workdir, env, on_step)
            if emulator is not None and latency_ms:
                b["delayed_requests"] = sum(r["fired"] for r in emulator.faults.rules())
                b["latency_ms"] = latency_ms
            progress.advance(steps - progress.done)
            progress.desc = "demo"  # the closing line: "demo: 8 of 8 steps (100%), 12 s (done)"
        wall = time.perf_counter() - wall0
        _print_table(console, cfg, a, b, wall)
        return 0 if b["identical"] else 1
    finally:
        if emulator is not None:
            emulator.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _start_emulator(console: Any) -> tuple[Any, str]:
    """An in-process Hub emulator with one write token and a private bucket."""
    from huggingface_hub import HfApi

    from kvbucket.testing import HubEmulator

    token = "hf_demo_" + secrets.token_hex(16)
    emulator = HubEmulator(tokens={DEMO_NAMESPACE: (token, "write")}).start()
    try:
        HfApi(endpoint=emulator.endpoint, token=token).create_bucket(
            f"{DEMO_NAMESPACE}/{DEMO_BUCKET}", private=True, exist_ok=True
        )
    except Exception:
        emulator.close()
        raise
    return emulator, token


def _fmt_bytes(n: float) -> str:
    from kvbucket.cli.stats_cmd import _fmt_bytes as fmt

    return fmt(n)


def _print_table(console: Any, cfg: DemoConfig, a: dict[str, Any], b: dict[str, Any], wall: float) -> None:
    from rich.table import Table

    ratio = b["ttft_hit"] / b["ttft_ref"] if b["ttft_ref"] else float("nan")
    table = Table(title="kvbucket demo: time to first token on machine B", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("prompt (document + question)", f"{b['prompt_tokens']:,} tokens")
    table.add_row("TTFT without cache", f"{b['ttft_ref']:.2f} s")
    if "latency_ms" in b:
        table.add_row("added latency (Hub emulator)",
                      f"{b['latency_ms']:g} ms on each of {b['delayed_requests']} requests")
    at = f" at {b['latency_ms']:g} ms" if "latency_ms" in b else ""
    table.add_row(f"TTFT with cache (cross-machine hit{at})", f"{b['ttft_hit']:.2f} s")
    table.add_row("ratio with / without", f"{ratio:.3f}" + ("  (goal <= 0.2)" if ratio > 0.2 else ""))
    table.add_row(
        "hit tokens", f"{b['hit_tokens']:,} of {b['prompt_tokens']:,} ({b['computed_tokens']} computed)"
    )
    table.add_row(
        "KV loaded (download + unpack)", f"{_fmt_bytes(b['bytes_loaded'])} in {b['load_seconds']:.2f} s"
    )
    table.add_row("machine A: chunks stored", f"{a['chunks_stored']} x {_fmt_bytes(a['chunk_bytes'])}"
                  + (f", {a['chunks_failed']} failed" if a["chunks_failed"] else ""))
    for role, res in (("A", a), ("B", b)):
        for t in res["tiers"]:
            if t["kind"] != "tier":
                continue
            table.add_row(
                f"machine {role}: {t['name']}",
                f"read {_fmt_bytes(t['bytes_read'])}, written {_fmt_bytes(t['bytes_written'])}",
            )
    failures = a.get("integrity_failures", 0) + b.get("integrity_failures", 0)
    refused = f"{failures:.0f} refused" if not failures else f"[red]{failures:.0f} refused[/red]"
    table.add_row("integrity: chunks verified on load",
                  f"{a.get('integrity_verified', 0) + b.get('integrity_verified', 0):.0f}, {refused}")
    table.add_row("first-token logits, max |diff|", f"{b['first_logit_max_diff']:.2e}")
    table.add_row("outputs identical", "[green]yes[/green]" if b["identical"] else "[red]NO[/red]")
    table.add_row("demo wall time", f"{wall:.0f} s")
    console.print(table)
    if not b["identical"]:
        console.print(f"with cache:    {b['output_with']}\nwithout cache: {b['output_without']}")


if __name__ == "__main__":
    sys.exit(_machine_main(sys.argv[1:]))
