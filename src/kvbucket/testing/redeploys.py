"""Model directories changed in place the ways teams redeploy under one name (issue 38).

Two bases: ``small`` (a config that sets every field the issue names, a multimodal
``text_config``/``vision_config``, three safetensors shards of attention and MLP tensors written
with the ``safetensors`` package, ``original/model.safetensors`` in a subfolder, a ``.bin`` and a
GGUF file, and the small files other tools read: :data:`SIDE_FILES`, remote code, a chat
template) and ``big`` (one 64 MiB safetensors file of 32 tensors of 2 MiB, real random bytes).
:data:`CHANGES` each change one thing in place; every one must give a new identity.
:data:`SAME` change nothing the KV depends on; every one must keep it. ``kv``: the engine's KV
fields the identity is computed with (KV cache dtype, quantization).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KV: dict[str, Any] = {"kv_cache_dtype": "bfloat16", "quantization": None}

CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "transformers_version": "4.57.0",
    "_name_or_path": "org/m", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "torch_dtype": "float16", "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
    "rms_norm_eps": 1e-5, "num_kv_heads": 2, "n_head_kv": 2, "rotary_emb_base": 10000,
    "rotary_emb_fraction": 0.5, "original_max_position_embeddings": 4096,
    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "multi_query_group_num": 2,
    "kv_channels": 16, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
    "residual_multiplier": 0.22, "logits_scaling": 8.0, "no_rope_layers": [1, 1], "clip_qkv": 8.0,
    "max_window_layers": 28, "hidden_act": "silu", "scale_embedding": False, "rope_interleave": True,
    "text_config": {"model_type": "llama", "rope_theta": 1000000.0, "sliding_window": 1024,
                    "num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                    "eos_token_id": 2},
    "vision_config": {"model_type": "siglip", "hidden_size": 32, "patch_size": 14},
}
LAYERS, HIDDEN = 2, 64
F16 = np.float16


def _tensors(seed: int, layers: range) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in layers:
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{m}.weight"] = rng.standard_normal((HIDDEN, HIDDEN)).astype(F16)
        for m in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.{m}.weight"] = rng.standard_normal((HIDDEN, 4 * HIDDEN)).astype(F16)
    return out


def _save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def _load(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


def write_raw_safetensors(path: Path, tensors: list[tuple[str, bytes]], dtype: str = "U8") -> None:
    """A safetensors file written by hand (for a large file without holding it as arrays twice)."""
    header: dict[str, Any] = {}
    off = 0
    for name, data in tensors:
        header[name] = {"dtype": dtype, "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, data in tensors:
            f.write(data)


#: Small files beside the weights: what other formats and tools read (Mistral's params.json,
#: AutoGPTQ, ModelOpt, an image processor) change the KV; the tokenizer's and generation's do not.
SIDE_FILES: dict[str, dict[str, Any]] = {
    "params.json": {"dim": 64, "n_layers": 2, "rope_theta": 1000000.0},
    "quantize_config.json": {"bits": 4, "group_size": 128},
    "hf_quant_config.json": {"quantization": {"quant_algo": "FP8"}},
    "preprocessor_config.json": {"size": {"height": 224, "width": 224}, "image_mean": [0.5, 0.5, 0.5]},
    "generation_config.json": {"temperature": 0.7},
    "tokenizer_config.json": {"model_max_length": 4096},
}


def _edit_json(name: str, update: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        doc = json.loads((d / name).read_text())
        update(doc)
        (d / name).write_text(json.dumps(doc))
    return change


def make_small(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "README.md").write_text("# a model\n")
    for s in range(3):
        _save(root / f"model-{s + 1:05d}-of-00003.safetensors", _tensors(s, range(s * 10, s * 10 + LAYERS)))
    _save(root / "original" / "model.safetensors", _tensors(7, range(1)))
    (root / "pytorch_model.bin").write_bytes(np.random.default_rng(8).bytes(1 << 16))
    (root / "model.gguf").write_bytes(b"GGUF" + np.random.default_rng(9).bytes(1 << 16))
    for name, doc in SIDE_FILES.items():
        (root / name).write_text(json.dumps(doc))
    (root / "modeling_custom.py").write_text("SCALE = 1.0\n")  # trust_remote_code
    (root / "chat_template.jinja").write_text("{{ messages }}")
    (root / "LICENSE").write_text("a licence\n")
    return root


BIG_TENSORS, BIG_TENSOR_BYTES = 32, 2 << 20  # 64 MiB


def make_big(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({k: CONFIG[k] for k in list(CONFIG)[:12]}))
    rng = np.random.default_rng(64)
    write_raw_safetensors(root / "model.safetensors",
                          [(f"t{i:02d}", rng.bytes(BIG_TENSOR_BYTES)) for i in range(BIG_TENSORS)])
    return root


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _overwrite(path: Path, offset: int, data: bytes, keep_mtime: bool = False) -> None:
    """Bytes written into the file in place (same inode, same size)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _flip(path: Path, offset: int, keep_mtime: bool = False) -> None:
    with open(path, "rb") as f:
        f.seek(offset)
        b = f.read(1)
    _overwrite(path, offset, bytes([b[0] ^ 0x01]), keep_mtime)


def _big_tensor(n: int, nbytes: int = BIG_TENSOR_BYTES, at: int = 0) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        f = d / "model.safetensors"
        data = np.random.default_rng(n + 1000).bytes(nbytes)
        _overwrite(f, _header_len(f) + n * BIG_TENSOR_BYTES + at, data)
    return change


def _config(update: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        update(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return change


def _set(key: str, value: Any, nested: str | None = None) -> Callable[[Path], None]:
    def update(cfg: dict[str, Any]) -> None:
        (cfg[nested] if nested else cfg)[key] = value
    return _config(update)


def _merge_lora(d: Path) -> None:
    """A rank-4 LoRA merged into q/k/v/o of every layer (the MLPs untouched), in every shard."""
    rng = np.random.default_rng(4)
    for f in sorted(d.glob("model-*.safetensors")):
        t = _load(f)
        for name in t:
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
                a, b = rng.standard_normal((HIDDEN, 4)), rng.standard_normal((4, HIDDEN))
                t[name] = (t[name] + (a @ b * 0.01)).astype(F16)
        _save(f, t)


def _one_tensor(d: Path) -> None:
    """One MLP tensor of the middle shard fine-tuned (every value nudged), the rest as they were."""
    f = d / "model-00002-of-00003.safetensors"
    t = _load(f)
    name = "model.layers.11.mlp.up_proj.weight"
    t[name] = (t[name] * 1.01).astype(F16)
    _save(f, t)


def _replace_shard(d: Path) -> None:
    f = d / "model-00003-of-00003.safetensors"
    f.unlink()
    _save(f, _tensors(99, range(20, 20 + LAYERS)))  # same names, shapes and size: other values


def _requantize(d: Path) -> None:
    """One tensor's dtype changed in the header only (F16 -> BF16), its bytes as they were."""
    f = d / "model-00001-of-00003.safetensors"
    n = _header_len(f) - 8
    raw = f.read_bytes()
    header = json.loads(raw[8:8 + n])
    header["model.layers.0.self_attn.k_proj.weight"]["dtype"] = "BF16"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@dataclass(frozen=True)
class Case:
    name: str
    base: str  # "small" or "big"
    change: Callable[[Path], None] | None = None
    kv: dict[str, Any] = field(default_factory=lambda: dict(KV))


def _kv(**kw: Any) -> dict[str, Any]:
    return {**KV, **kw}


def _touch_all(d: Path) -> None:
    for f in d.rglob("*"):
        if f.is_file():
            os.utime(f, (1_500_000_000, 1_500_000_000))


CHANGES: tuple[Case, ...] = (
    # weights: one tensor among many, anywhere in a file
    # (31-33 MiB: between two of the blocks the sampling fingerprint read, ~30.4 and ~34.6 MiB)
    Case("big: 2 MiB changed in the middle of a 64 MiB file", "big", _big_tensor(15, 2 << 20, at=1 << 20)),
    Case("big: the last tensor changed", "big", _big_tensor(BIG_TENSORS - 1)),
    Case("big: the first tensor's first byte flipped",
         "big", lambda d: _flip(d / "model.safetensors", _header_len(d / "model.safetensors"))),
    Case("big: one byte flipped mid-file, mtime set back", "big",
         lambda d: _flip(d / "model.safetensors", 33 << 20, keep_mtime=True)),
    Case("big: 4 KiB changed near the end", "big", _big_tensor(BIG_TENSORS - 2, 4096, at=1 << 20)),
    Case("one MLP tensor of the middle shard fine-tuned", "small", _one_tensor),
    Case("a merged LoRA on q/k/v/o only", "small", _merge_lora),
    Case("one shard of a sharded model replaced", "small", _replace_shard),
    Case("a re-quantized tensor (header dtype only)", "small", _requantize),
    Case("weights in a subfolder (original/model.safetensors) changed", "small",
         lambda d: _flip(d / "original" / "model.safetensors", 4000)),
    Case("a pytorch .bin changed", "small", lambda d: _flip(d / "pytorch_model.bin", 100)),
    Case("a GGUF file changed", "small", lambda d: _flip(d / "model.gguf", 5000)),
    Case("a large file of no known suffix added", "small",
         lambda d: (d / "weights.data").write_bytes(np.random.default_rng(5).bytes(5 << 20))),
    Case("an adapter's weights added", "small",
         lambda d: _save(d / "adapter" / "adapter_model.safetensors", _tensors(6, range(1)))),
    Case("a shard renamed", "small", lambda d: (d / "original" / "model.safetensors").rename(
        d / "original" / "consolidated.safetensors")),
    # config fields of other model families (the 18 cases)
    *(Case(f"config {k}", "small", _set(k, v)) for k, v in (
        ("rms_norm_eps", 1e-6), ("num_kv_heads", 4), ("n_head_kv", 4), ("rotary_emb_base", 500000),
        ("rotary_emb_fraction", 0.25), ("original_max_position_embeddings", 8192),
        ("rope_local_base_freq", 20000.0), ("sliding_window_pattern", 4), ("multi_query_group_num", 4),
        ("kv_channels", 32), ("embedding_multiplier", 10.0), ("attention_multiplier", 0.015625),
        ("residual_multiplier", 0.3), ("logits_scaling", 4.0), ("no_rope_layers", [1, 0]),
        ("clip_qkv", 4.0), ("max_window_layers", 14), ("hidden_act", "gelu"), ("scale_embedding", True),
        ("rope_interleave", False), ("rope_theta", 20000.0), ("max_position_embeddings", 8192))),
    # multimodal: the nested text config, and the vision tower
    *(Case(f"config text_config.{k}", "small", _set(k, v, "text_config")) for k, v in (
        ("rope_theta", 500000.0), ("sliding_window", 4096), ("num_key_value_heads", 4),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}))),
    Case("config vision_config.patch_size", "small", _set("patch_size", 16, "vision_config")),
    Case("a new config field no list knows", "small", _set("attn_temperature_tuning", 4)),
    Case("quantization_config added", "small", _set("quantization_config", {"quant_method": "fp8"})),
    # small files other than config.json: every one counts but the tokenizer's, generation's, docs
    Case("params.json (Mistral format) rope_theta", "small",
         _edit_json("params.json", lambda c: c.update(rope_theta=500000.0))),
    Case("quantize_config.json (AutoGPTQ) bits", "small", _edit_json("quantize_config.json",
                                                                     lambda c: c.update(bits=8))),
    Case("hf_quant_config.json (ModelOpt) algorithm", "small",
         _edit_json("hf_quant_config.json", lambda c: c.update(quantization={"quant_algo": "NVFP4"}))),
    Case("preprocessor_config.json image size", "small",
         _edit_json("preprocessor_config.json", lambda c: c.update(size={"height": 336, "width": 336}))),
    Case("remote code (modeling_custom.py) changed", "small",
         lambda d: (d / "modeling_custom.py").write_text("SCALE = 2.0\n")),
    Case("a small file no list knows added", "small",
         lambda d: (d / "attention_sinks.json").write_text('{"sinks": 4}')),
    Case("KV cache dtype fp8", "small", kv=_kv(kv_cache_dtype="fp8_e4m3")),
    Case("engine quantization fp8", "small", kv=_kv(quantization="fp8")),
)

SAME: tuple[Case, ...] = (
    Case("every file touched (new mtime)", "small", _touch_all),
    Case("the big file touched", "big", _touch_all),
    Case("architectures, transformers_version, _name_or_path, token ids and generation settings",
         "small", _config(lambda c: c.update(architectures=["Other"], transformers_version="5.0",
                                             _name_or_path="/elsewhere", eos_token_id=[2, 3],
                                             temperature=0.6, top_p=0.9))),
    Case("README changed, a small tokenizer file added", "small",
         lambda d: ((d / "README.md").write_text("# v2\n"), (d / "tokenizer.json").write_text("{}"))),
    Case("generation_config.json, tokenizer_config.json, chat template and LICENSE changed", "small",
         lambda d: (_edit_json("generation_config.json", lambda c: c.update(temperature=0.1))(d),
                    _edit_json("tokenizer_config.json", lambda c: c.update(model_max_length=8192))(d),
                    (d / "chat_template.jinja").write_text("{{ other }}"),
                    (d / "LICENSE").write_text("another licence\n"))),
    Case("a hidden .cache folder added", "small",
         lambda d: (d / ".cache").mkdir() or (d / ".cache" / "x.safetensors").write_bytes(b"x" * 100)),
    Case("config.json rewritten with its keys in another order", "small",
         _config(lambda c: [c.update({k: c.pop(k)}) for k in sorted(c, reverse=True)])),
)


def prepare(root: Path, cases: tuple[Case, ...]) -> dict[str, Path]:
    """One copy of its base per case (a fresh path each): case name -> directory."""
    bases = {"small": make_small(root / "base-small" / "m"), "big": make_big(root / "base-big" / "m")}
    out = {}
    for i, case in enumerate(cases):
        d = root / f"case-{i:02d}" / "m"
        shutil.copytree(bases[case.base], d)
        out[case.name] = d
    return out


__all__ = ["CHANGES", "CONFIG", "KV", "SAME", "SIDE_FILES", "Case", "make_big", "make_small", "prepare",
           "write_raw_safetensors"]
