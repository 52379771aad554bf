"""Does a remote KV hit beat recomputing the prompt? The arithmetic, and a measurement of a store.

A cross-machine hit replaces a prefill: it pays only when lookup + load finish before the GPU
would have recomputed the prompt. For a model shape (layers, KV heads, head dim, dtype) the KV
of a prompt is ``2 x layers x KV heads x head dim x dtype bytes`` per token. A load of it costs
a fixed number of sequential round trips plus its bytes over the store's throughput:

    hit = round trips x RTT + KV bytes / throughput      vs      prefill = tokens / prefill rate

Prefill rates are anchored at 10,000-20,000 tokens/s for an 8B model on one H100 (published
serving figures vary with batch and kernels) and scaled by parameter count for other shapes:
prefill is compute-bound, about 2 x parameters FLOPs per token. :func:`break_even_table` is the
table of docs/remote-hit.md; :func:`measure` times a real store (``kvbucket doctor URL --model``)
with random payloads, small and chunk-sized, removed afterwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbucket.chunks import KVLayout
from kvbucket.stores.base import ObjectStore

GB = 1e9  # throughput in decimal GB/s, as networks are quoted
MIB = 2**20
CHUNK_TOKENS = 256
PROMPT_TOKENS = 4096
#: tokens/s an 8B model prefills on one H100, the anchor of every shape's rate
PREFILL_8B = (10_000.0, 20_000.0)
ANCHOR_PARAMS_B = 8.03
#: the round trips of a load whose critical path is constant: lookup, reconstruction, fetch (Hub)
FLOOR_ROUND_TRIPS = 3
TABLE_LATENCY_MS = 50.0


@dataclass(frozen=True)
class ModelShape:
    """What sets a model's KV size and its prefill speed."""

    name: str
    layout: KVLayout
    params_b: float  # parameters, billions
    gpus: int = 1  # the GPUs one replica prefills on (tensor parallel)

    @property
    def prefill_tokens_per_s(self) -> tuple[float, float]:
        scale = ANCHOR_PARAMS_B / self.params_b * self.gpus
        return PREFILL_8B[0] * scale, PREFILL_8B[1] * scale

    def describe(self) -> str:
        lay = self.layout
        tp = f", {self.gpus} GPUs" if self.gpus > 1 else ""
        return (f"{lay.num_layers} layers x {lay.num_kv_heads} KV heads x {lay.head_size} head dim, "
                f"{lay.dtype}, {self.params_b:g}B parameters{tp}")


def _shape(name: str, layers: int, kv_heads: int, head_dim: int, params_b: float,
           gpus: int = 1) -> ModelShape:
    return ModelShape(name, KVLayout(layers, kv_heads, head_dim, "bfloat16", CHUNK_TOKENS), params_b, gpus)


#: shapes from each model's config.json (bf16, 256-token chunks)
MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _shape("qwen2.5-0.5b", 24, 2, 64, 0.49),
    _shape("llama-3.2-1b", 16, 8, 64, 1.24),
    _shape("llama-3.2-3b", 28, 8, 128, 3.21),
    _shape("llama-3.1-8b", 32, 8, 128, 8.03),
    _shape("qwen3-8b", 36, 8, 128, 8.19),
    _shape("llama-3.1-70b", 80, 8, 128, 70.6, gpus=8),
)}


@dataclass(frozen=True)
class Budget:
    """What a hit on ``tokens`` of a prompt has to beat."""

    shape: ModelShape
    tokens: int = PROMPT_TOKENS

    @property
    def kv_bytes(self) -> int:
        return self.shape.layout.bytes_per_token * self.tokens

    @property
    def chunks(self) -> int:
        return math.ceil(self.tokens / self.shape.layout.chunk_tokens)

    @property
    def prefill_s(self) -> tuple[float, float]:
        """Recompute time on a fast and on a slow GPU (the fast one is the tighter budget)."""
        fast, slow = self.shape.prefill_tokens_per_s[1], self.shape.prefill_tokens_per_s[0]
        return self.tokens / fast, self.tokens / slow

    def needed_gbps(self, prefill_s: float, round_trips: float = 0, rtt_s: float = 0.0) -> float:
        """Throughput (GB/s) a hit needs to tie with ``prefill_s``; inf when the round trips alone lose."""
        left = prefill_s - round_trips * rtt_s
        return self.kv_bytes / left / GB if left > 0 else math.inf

    def round_trips_that_fit(self, prefill_s: float, rtt_s: float) -> int:
        """Sequential round trips of ``rtt_s`` that fit in ``prefill_s`` (with endless throughput)."""
        return int(prefill_s / rtt_s)

    def hit_s(self, fixed_s: float, gbps: float) -> float:
        return fixed_s + self.kv_bytes / (gbps * GB)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _gbps(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f} GB/s" if x >= 1 else f"{x * 1000:.0f} MB/s"


def _span(low: str, high: str) -> str:
    """``low-high`` with the unit once, or one value when both ends agree."""
    if low == high:
        return low
    lo_num, _, lo_unit = low.partition(" ")
    hi_num, _, hi_unit = high.partition(" ")
    if lo_unit == hi_unit:
        return f"{lo_num}-{hi_num}" + (f" {lo_unit}" if lo_unit else "")
    return f"{low} to {high}"


def break_even_table(tokens: int = PROMPT_TOKENS, latency_ms: float = TABLE_LATENCY_MS) -> str:
    """docs/remote-hit.md's table: for each shape, what a hit on a ``tokens`` prompt must achieve."""
    lat = latency_ms / 1000
    head = (
        "| model | KV shape | KV per token | prompt | KV of the prompt | GPU prefill | prefill time | "
        f"throughput a hit needs at 0 ms | at {latency_ms:g} ms x {FLOOR_ROUND_TRIPS} round trips | "
        f"round trips that fit at {latency_ms:g} ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for shape in MODEL_SHAPES.values():
        b = Budget(shape, tokens)
        fast, slow = b.prefill_s
        lo, hi = shape.prefill_tokens_per_s
        lay = shape.layout
        gpus = f" ({shape.gpus} GPUs)" if shape.gpus > 1 else ""
        with_rtt = _span(_gbps(b.needed_gbps(slow, FLOOR_ROUND_TRIPS, lat)),
                         _gbps(b.needed_gbps(fast, FLOOR_ROUND_TRIPS, lat)))
        rows.append(
            f"| {shape.name} | {lay.num_layers} x {lay.num_kv_heads} x {lay.head_size}, {lay.dtype} | "
            f"{human_bytes(lay.bytes_per_token)} | {tokens:,} tokens ({b.chunks} x "
            f"{human_bytes(lay.full_chunk_bytes)}) | {human_bytes(b.kv_bytes)} | "
            f"{lo:,.0f}-{hi:,.0f} tokens/s{gpus} | {fast:.2f}-{slow:.2f} s | "
            f"{_span(_gbps(b.needed_gbps(slow)), _gbps(b.needed_gbps(fast)))} | {with_rtt} | "
            f"{_span(str(b.round_trips_that_fit(fast, lat)), str(b.round_trips_that_fit(slow, lat)))} |"
        )
    return "\n".join(rows)


# ---- measuring a store -------------------------------------------------------------------------------
SMALL_BYTES = 4096
SMALL_OBJECTS = 16  # as many as a 4,096-token prompt has chunks
CHUNK_OBJECTS = 4
RTT_SAMPLES = 5
DOCTOR_PREFIX = "_kvbucket_doctor"
LOCAL_RTT_S = 0.001  # a lookup faster than this went to no network


@dataclass
class Measurement:
    """What :func:`measure` saw. Times are wall-clock seconds of the calls kvbucket makes."""

    rtt_s: float  # one lookup of one object (median)
    small_objects: int
    small_load_s: float  # lookup + load of the small objects: the fixed cost of a load of as many
    chunk_bytes: int
    chunk_objects: int
    chunk_load_s: float  # lookup + load of the chunk-sized objects

    @property
    def round_trips(self) -> float | None:
        """The sequential round trips of a load's fixed cost (small-object load / one lookup);
        None for a local store, whose lookups take no network round trip."""
        return self.small_load_s / self.rtt_s if self.rtt_s >= LOCAL_RTT_S else None

    @property
    def gbps(self) -> float:
        """Throughput of the chunk load once its fixed cost is paid (at least a tenth of its time)."""
        transfer = max(self.chunk_load_s - self.small_load_s, self.chunk_load_s / 10, 1e-6)
        return self.chunk_bytes * self.chunk_objects / transfer / GB


class MeasureFailed(RuntimeError):
    """:func:`measure` failed; ``left``: the prefix of the objects its cleanup could not confirm
    removed (None: all were removed)."""

    def __init__(self, message: str, left: str | None) -> None:
        super().__init__(message)
        self.left = left


def new_run() -> str:
    """A fresh prefix for one measurement's objects (``_kvbucket_doctor/<random>``)."""
    import secrets  # here, as in measure(): `kvbucket doctor --help` (every start) imports this module

    return f"{DOCTOR_PREFIX}/{secrets.token_hex(6)}"


def measure(open_store: Callable[[], ObjectStore], chunk_bytes: int, *, small_objects: int = SMALL_OBJECTS,
            chunk_objects: int = CHUNK_OBJECTS, run: str | None = None) -> Measurement:
    """Time lookups and loads on a store as another machine sees it: one instance writes random
    payloads under ``run`` (default :func:`new_run`; small and chunk-sized), a second one, with
    nothing cached, looks them up and loads them (each verified byte for byte); all are removed
    before returning. The reader is warmed by one load first (connection, read token), as in a
    running engine. Failing, it raises :class:`MeasureFailed` saying whether objects remain."""
    import secrets
    import statistics  # with fractions and decimal, ~5 ms of every `kvbucket` start if at the top

    run = run or new_run()
    small = [(f"{run}/small-{i}", secrets.token_bytes(SMALL_BYTES))
             for i in range(1 + RTT_SAMPLES + small_objects)]  # warm-up, lookups, the load
    big = [(f"{run}/chunk-{i}", secrets.token_bytes(chunk_bytes)) for i in range(chunk_objects)]
    names = [n for n, _ in small + big]
    with open_store() as writer:
        try:
            for batch in (small, big):
                failed = [r for r in writer.put_many(batch) if not r.ok]
                if failed:
                    raise failed[0].error or RuntimeError(f"storing {failed[0].name} failed")
            with open_store() as reader:
                _load(reader, small[:1])
                rtt = statistics.median(_timed(lambda n=n: reader.head_many([n]))
                                        for n, _ in small[1:RTT_SAMPLES + 1])
                small_s = _timed(lambda: _load(reader, small[RTT_SAMPLES + 1:]))
                big_s = _timed(lambda: _load(reader, big))
        except Exception as e:
            raise MeasureFailed(str(e) or type(e).__name__, None if _removed(writer, names) else run) from e
        if not _removed(writer, names):
            raise MeasureFailed("measured, but removing its objects failed", run)
    return Measurement(rtt, small_objects, small_s, chunk_bytes, chunk_objects, big_s)


def _removed(store: ObjectStore, names: list[str]) -> bool:
    """Delete ``names``; True when the store confirmed each gone (removed, or never written)."""
    try:
        return all(r.ok for r in store.delete_many(names))
    except Exception:
        return False


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _load(store: ObjectStore, items: list[tuple[str, bytes]]) -> None:
    """A hit as kvbucket's tiers make it: one lookup of the batch, then one load into buffers."""
    names = [n for n, _ in items]
    sizes = [r.size for r in store.head_many(names)]
    if None in sizes:
        raise RuntimeError(f"{names[sizes.index(None)]} was stored but a lookup does not find it")
    out = [bytearray(s or 0) for s in sizes]
    for r, (_, data), buf in zip(store.get_many(names, out), items, out, strict=True):
        if r.error is not None:  # a timeout or a refusal: not an answer about the object
            raise RuntimeError(f"loading {r.name} failed: {r.error}")
        if not r.found or buf != data:
            raise RuntimeError(f"{r.name} came back {'damaged' if r.found else 'missing'}")


def verdict(budget: Budget, m: Measurement) -> tuple[bool | None, list[str]]:
    """Whether a hit beats recompute on a fast GPU (True), only on a slow one (None) or never (False),
    with the lines that say why."""
    hit = budget.hit_s(m.small_load_s, m.gbps)
    fast, slow = budget.prefill_s
    lo, hi = budget.shape.prefill_tokens_per_s
    kv = human_bytes(budget.kv_bytes)
    lines = [
        f"a hit on {budget.tokens:,} tokens ({budget.chunks} chunks, {kv}) would take "
        f"{m.small_load_s * 1000:.0f} ms of round trips + {kv} at {_gbps(m.gbps)} = {hit:.2f} s",
        f"recomputing it takes {fast:.2f}-{slow:.2f} s on a GPU prefilling {lo:,.0f}-{hi:,.0f} tokens/s",
    ]
    left = fast - m.small_load_s
    need = budget.kv_bytes / left / GB if left > 0 else math.inf
    if hit <= fast:
        return True, [*lines, "verdict: a remote hit beats recompute"]
    if hit <= slow:
        return None, [*lines, f"verdict: a remote hit beats only a slower GPU; against the fastest it needs "
                              f"{_gbps(need)} after these round trips"]
    if math.isinf(need):
        fits = (f" (at most {budget.round_trips_that_fit(fast, m.rtt_s)} of {m.rtt_s * 1000:.0f} ms fit)"
                if m.round_trips is not None else "")
        why = f"the round trips of a load alone take {m.small_load_s:.2f} s{fits}"
    else:
        why = f"it needs {_gbps(need)} after these round trips"
    return False, [*lines, f"verdict: recompute wins; {why}"]


__all__ = ["MODEL_SHAPES", "Budget", "MeasureFailed", "Measurement", "ModelShape", "break_even_table",
           "measure", "new_run", "verdict"]
