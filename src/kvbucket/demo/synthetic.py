"""The synthetic demo: model-shaped KV chunks through the hybrid stack, every byte verified.

No model and no network: chunks shaped like a real model's KV cache (LMCache layout, bf16
values drawn from a normal distribution) are written through local_cpu -> local_disk -> remote,
read back from each tier on its own, then read by a "fresh engine" (empty local tiers, the same
remote) the way a second machine would, with promotion into its local tiers. Every read is
compared with the bytes that were written; any difference makes the demo fail.

The remote is an embedded FileStore in a temp directory unless ``target`` names a store
(``file://``, ``hf://buckets/...``, ``s3://...``); the demo's chunks are removed from a target
afterwards unless ``keep``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import GB, EngineConfig, build_backend, load_engine_config
from kvbucket.keys import CacheEngineKey
from kvbucket.metrics import integrity_totals

#: KV layouts of real models (layers, KV heads, head size; bf16; 256-token chunks).
MODELS: dict[str, KVLayout] = {
    "qwen2.5-0.5b": KVLayout(24, 2, 64, "bfloat16"),  # 3 MiB a chunk
    "llama-3.2-1b": KVLayout(16, 8, 64, "bfloat16"),  # 8 MiB a chunk
    "llama-3.1-8b": KVLayout(32, 8, 128, "bfloat16"),  # 32 MiB a chunk
}
DEFAULT_MODEL = "llama-3.2-1b"
BATCH = 4


class DemoError(Exception):
    """The demo could not run (bad option, unreachable target); the message says why."""


@dataclass
class PhaseResult:
    name: str
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verified: int = 0
    failed: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.seconds / 1024**3 if self.seconds > 0 else 0.0


@dataclass
class DemoReport:
    model: str
    layout: KVLayout
    remote: str
    phases: list[PhaseResult] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    integrity_verified: int = 0  # envelopes verified on the loads of persistent tiers
    integrity_failures: int = 0  # objects refused (never served)

    @property
    def ok(self) -> bool:
        return all(p.failed == 0 and p.verified == p.chunks for p in self.phases)


def chunk_data(layout: KVLayout, seed: bytes, i: int) -> np.ndarray:
    """Chunk ``i``: bf16 bits of N(0, 1) values in LMCache's layout, reproducible from ``seed``.

    One block of values is drawn per (layout, seed) and each chunk is that block rotated by a
    chunk-specific offset with the chunk's index and a digest stamped in front, so every chunk
    differs (a swapped or shifted chunk is caught) while costing one copy to make.
    """
    base = _base_block(layout, seed)
    flat = np.roll(base, (i * 7919 + 1) % base.size)
    stamp = np.frombuffer(hashlib.blake2b(seed + struct.pack("<q", i), digest_size=16).digest(), np.uint8)
    flat.view(np.uint8)[:16] = stamp
    return flat.reshape(layout.shape) if flat.dtype == np.uint16 else flat


_BASE: dict[tuple[KVLayout, bytes], np.ndarray] = {}


def _base_block(layout: KVLayout, seed: bytes) -> np.ndarray:
    block = _BASE.get((layout, seed))
    if block is None:
        rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(seed).digest()[:8]))
        values = rng.standard_normal(layout.full_chunk_bytes // 4, dtype=np.float32)
        block = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16: the top half of float32
        if layout.itemsize != 2:
            block = block.view(np.uint8)
            block = np.resize(block, layout.full_chunk_bytes)
        else:
            block = np.concatenate([block, block])  # full_chunk_bytes // 2 bf16 values
        _BASE.clear()  # one layout at a time: a demo run uses one
        _BASE[(layout, seed)] = block
    return block


def chunk_keys(model: str, layout: KVLayout, seed: bytes, n: int) -> list[CacheEngineKey]:
    """Prefix-chained keys, as an engine derives them (chunk i's hash covers chunks 0..i)."""
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.blake2b(prev + struct.pack("<q", i), digest_size=8).digest()
        keys.append(CacheEngineKey(f"kvbucket-demo/{model}", 1, 0, int.from_bytes(prev, "big", signed=True),
                                   layout.dtype))
    return keys


def _batches(n: int) -> Iterator[range]:
    for start in range(0, n, BATCH):
        yield range(start, min(start + BATCH, n))


def run_synthetic_demo(
    *,
    target: str | None = None,
    chunks: int = 32,
    model: str = DEFAULT_MODEL,
    keep: bool = False,
    config_path: str | None = None,
    console: Console | None = None,
) -> DemoReport:
    """Run the demo and print its progress and summary; the report says whether all bytes matched."""
    console = console or Console()
    if model not in MODELS:
        raise DemoError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if chunks <= 0:
        raise DemoError("--chunks must be positive")
    layout = MODELS[model]
    seed = os.urandom(16)  # a fresh run id: runs sharing a bucket never read each other's chunks
    keys = chunk_keys(model, layout, seed, chunks)
    total = chunks * layout.full_chunk_bytes
    workdir = Path(tempfile.mkdtemp(prefix="kvbucket-demo-"))
    try:
        config = _engine_config(target, config_path, workdir, layout, total)
        remote_label = config.remote_url or ", ".join(config.remote_storage_plugins)
        console.print(
            f"[bold]kvbucket demo (synthetic)[/bold]: {chunks} chunks of {model} KV "
            f"({layout.describe()}; {layout.full_chunk_bytes / 2**20:.0f} MiB each, {total / 2**20:.0f} MiB "
            f"in all)\n  local_cpu -> local_disk ({workdir / 'disk'}) -> remote ({remote_label})"
        )
        report = DemoReport(model, layout, remote_label)
        checks_before = integrity_totals()
        backend = build_backend(config, layout)
        if not isinstance(backend, HybridBackend):  # pragma: no cover - the config always has 3 tiers
            raise DemoError("the demo needs a local_cpu -> local_disk -> remote stack")
        try:
            _run_phases(backend, keys, layout, seed, workdir, report, console)
        finally:
            try:
                embedded = config.remote_url == f"file://{workdir / 'remote'}"
                if not keep and not embedded:  # a user's store: take back what the demo put there
                    for k in keys:
                        for tier in backend.tiers[2:]:
                            tier.remove(k)
            finally:
                backend.close()
        checks = integrity_totals()
        report.integrity_verified = int(checks[0] - checks_before[0])
        report.integrity_failures = int(checks[1] - checks_before[1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _print_summary(report, console)
    return report


def _engine_config(target: str | None, config_path: str | None, workdir: Path, layout: KVLayout,
                   total: int) -> EngineConfig:
    # The file and the KVBUCKET_* variables, read as an engine reads them (a bad value is refused);
    # without --config the demo's own embedded remote, unless --target. The local tiers are the demo's.
    engine = load_engine_config(config_path)
    base = engine if config_path else EngineConfig()
    room = (total + layout.full_chunk_bytes) / GB
    remote_url = target or base.remote_url
    if remote_url is None and not base.remote_storage_plugins:
        remote_url = f"file://{workdir / 'remote'}"  # the embedded default: no token, no network
    if remote_url is not None and "://" not in remote_url:
        remote_url = f"file://{os.path.abspath(remote_url)}"
    return EngineConfig.model_validate({
        **base.model_dump(),
        "chunk_size": layout.chunk_tokens,
        "local_cpu": True,
        "max_local_cpu_size": room,
        "local_disk": str(workdir / "disk"),
        "max_local_disk_size": room,
        "remote_url": remote_url,
    })


def _run_phases(backend: HybridBackend, keys: Sequence[CacheEngineKey], layout: KVLayout, seed: bytes,
                workdir: Path, report: DemoReport, console: Console) -> None:
    n = len(keys)
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    bars = sys.stderr.isatty()  # in a log: a line as each phase starts, then every few seconds
    with Progress(*columns, console=console) if bars else _PhaseLines() as progress:
        # 1. write-through: every chunk lands in every tier
        phase = PhaseResult("store (write-through, all tiers)")
        task = progress.add_task(phase.name, total=n)
        for batch in _batches(n):
            items = [(keys[i], chunk_data(layout, seed, i)) for i in batch]
            t0 = time.perf_counter()
            stored = backend.batched_put(items)
            backend.flush()
            phase.seconds += time.perf_counter() - t0
            phase.chunks += len(batch)
            phase.bytes += stored * layout.full_chunk_bytes
            phase.verified += stored
            phase.failed += len(batch) - stored
            progress.advance(task, len(batch))
        report.phases.append(phase)

        # 2. each tier on its own
        names = ["read local_cpu", "read local_disk"] + ["read remote"] * (len(backend.tiers) - 2)
        for name, tier in zip(names, backend.tiers, strict=True):
            report.phases.append(_read_phase(name, tier, keys, layout, seed, progress))

        # 3. another machine: empty local tiers, the same remote; hits are promoted locally
        remotes = backend.tiers[2:]
        cap = n * layout.full_chunk_bytes + layout.full_chunk_bytes
        fresh_cpu, fresh_disk = LocalCPUBackend(cap), LocalDiskBackend(workdir / "disk-b", cap)
        fresh = HybridBackend([fresh_cpu, fresh_disk, *remotes])
        try:
            report.phases.append(_read_phase("fresh engine: read-through", fresh, keys, layout, seed,
                                             progress))
            report.phases.append(_read_phase("fresh engine: again (promoted)", fresh, keys, layout, seed,
                                             progress))
            report.hits = list(fresh.hits)
        finally:
            fresh_cpu.close()
            fresh_disk.close()


class _PhaseLines:
    """rich Progress's ``add_task``/``advance`` as :mod:`kvbucket.progress` lines on stderr."""

    def __init__(self) -> None:
        self._phase: Any = None

    def add_task(self, name: str, total: int) -> int:
        from kvbucket.progress import Progress as Lines

        self.close()
        self._phase = Lines(name, total=total, unit="chunks")  # a phase shorter than a tick prints nothing
        return 0

    def advance(self, task: int, n: int) -> None:
        self._phase.advance(n)

    def close(self) -> None:
        if self._phase is not None:
            self._phase.close()

    def __enter__(self) -> _PhaseLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_phase(name: str, tier: StorageBackend, keys: Sequence[CacheEngineKey], layout: KVLayout,
                seed: bytes, progress: Progress | _PhaseLines) -> PhaseResult:
    phase = PhaseResult(name)
    task = progress.add_task(name, total=len(keys))
    for batch in _batches(len(keys)):
        bufs = [np.empty(layout.full_chunk_bytes, dtype=np.uint8) for _ in batch]
        for b in bufs:
            b.fill(0)  # pages touched before timing, as an engine's reused KV buffers are
        t0 = time.perf_counter()
        found = tier.batched_get_into([keys[i] for i in batch], bufs)
        phase.seconds += time.perf_counter() - t0
        for i, buf, ok in zip(batch, bufs, found, strict=True):
            phase.chunks += 1
            if ok and np.array_equal(buf, chunk_data(layout, seed, i).reshape(-1).view(np.uint8)):
                phase.verified += 1
                phase.bytes += layout.full_chunk_bytes
            else:
                phase.failed += 1
        progress.advance(task, len(batch))
    return phase


def _print_summary(report: DemoReport, console: Console) -> None:
    table = Table(title=f"kvbucket demo (synthetic): {report.model}, remote = {report.remote}")
    for col, just in (("phase", "left"), ("chunks", "right"), ("MiB", "right"), ("seconds", "right"),
                      ("GiB/s", "right"), ("verified", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for p in report.phases:
        verified = f"{p.verified}/{p.chunks}"
        table.add_row(p.name, str(p.chunks), f"{p.bytes / 2**20:.0f}", f"{p.seconds:.3f}",
                      f"{p.gib_per_s:.2f}", verified if p.failed == 0 else f"[red]{verified}[/red]")
    refused = f"{report.integrity_failures} refused"
    table.add_row("integrity (envelopes)", str(report.integrity_verified), "", "", "",
                  refused if report.integrity_failures == 0 else f"[red]{refused}[/red]")
    console.print(table)
    if report.hits:
        console.print(f"fresh engine hits per tier (local_cpu, local_disk, remote): {report.hits}")
    if report.ok:
        reads = sum(p.chunks for p in report.phases[1:])
        console.print(f"[green]all bytes verified[/green]: {reads} chunk reads matched what was written")
    else:
        bad = sum(p.failed for p in report.phases)
        console.print(f"[red]FAILED[/red]: {bad} chunk reads or writes did not match or did not land")


__all__ = ["MODELS", "DemoError", "DemoReport", "PhaseResult", "chunk_data", "chunk_keys",
           "run_synthetic_demo"]
