"""Random-weight Llama-architecture models for the demo and tests (no downloads).

The weights come from a fixed seed, so two processes (the demo's "machine A" and "machine B")
build bit-identical models without sharing a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """The shape of the demo model. ``QWEN05B_LIKE`` mirrors Qwen2.5-0.5B but for a smaller vocab."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int = 8192
    #: std of the random weights. Small models with tied embeddings and the usual 0.02 just repeat
    #: one token; a larger std gives varied greedy outputs, so "outputs identical" means something.
    init_std: float = 0.02

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864 (vocab 151,936).
# The vocabulary is cut to 32,000 (Llama-2's): it only sizes the embedding and the last matmul,
# and the demo's prompt is random token ids, so attention and MLP work are those of the real model.
QWEN05B_LIKE = ModelDims(896, 24, 14, 2, 4864, 32000)
# Seconds on CPU: the shape tests and `KVBUCKET_DEMO_SIZE=tiny` use.
TINY = ModelDims(64, 2, 4, 2, 128, 256, max_positions=4096, init_std=0.2)
SIZES = {"qwen0.5b-like": QWEN05B_LIKE, "tiny": TINY}


def build_model(dims: ModelDims, *, seed: int = 0, dtype: Any = None, name: str | None = None) -> Any:
    """A ``LlamaForCausalLM`` with seeded random weights, in eval mode."""
    import torch

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=dims.hidden_size,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        intermediate_size=dims.intermediate_size,
        vocab_size=dims.vocab_size,
        max_position_embeddings=dims.max_positions,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        initializer_range=dims.init_std,
    )
    if name:
        config._name_or_path = name
    cpu_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(cpu_rng)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
