"""KV layouts, zero-copy views and the serde registry."""

from __future__ import annotations

import numpy as np
import pytest

from kvbucket.chunks import KVLayout, as_view, dtype_size, get_serde, supported_serdes
from kvbucket.errors import ConfigError


def test_llama_3_1_8b_bf16_chunk_is_32_mib() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert layout.shape == (32, 2, 256, 8, 128)
    assert layout.full_chunk_bytes == 32 * 1024 * 1024


def test_mla_layout_has_one_latent_per_token() -> None:
    # DeepSeek-V3: 61 layers, a 576-wide latent (512 + 64 rope) per token, bf16
    layout = KVLayout(61, 1, 576, "bfloat16", use_mla=True)
    assert layout.shape == (61, 1, 256, 1, 576)
    assert layout.full_chunk_bytes == 61 * 256 * 576 * 2
    assert layout.with_chunk_tokens(512).full_chunk_bytes == 2 * layout.full_chunk_bytes


@pytest.mark.parametrize(("name", "size"), [("bfloat16", 2), ("torch.float16", 2), ("float32", 4),
                                            ("float8_e4m3fn", 1), ("float8_e5m2", 1), ("half", 2)])
def test_dtype_sizes(name: str, size: int) -> None:
    assert dtype_size(name) == size


def test_unknown_dtype_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown KV dtype 'bfloat61'.*Did you mean 'bfloat16'.*Supported"):
        KVLayout(2, 2, 16, "bfloat61")


def test_layout_rejects_nonsense_dims() -> None:
    with pytest.raises(ConfigError, match="num_layers must be a positive integer"):
        KVLayout(0, 2, 16)


def test_torch_dtype_objects_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    assert KVLayout(1, 1, 1, torch.bfloat16).itemsize == 2  # type: ignore[arg-type]
    assert KVLayout(1, 1, 1, torch.bfloat16).dtype == "bfloat16"  # type: ignore[arg-type]


def test_as_view_does_not_copy_numpy() -> None:
    arr = np.zeros((4, 8), dtype=np.float16)
    view = as_view(arr)
    assert view.nbytes == 64 and view.format == "B" and view.ndim == 1
    arr[0, 0] = 1.0
    assert view[:2].tobytes() == arr[0, :1].tobytes()  # same memory


def test_as_view_does_not_copy_torch_bf16_or_fp8() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(16, dtype=torch.bfloat16)
    view = as_view(t)
    assert view.nbytes == 32
    t[0] = 1.0
    assert view[:2].tobytes() == t[:1].view(torch.uint8).numpy().tobytes() != b"\x00\x00"
    assert as_view(torch.zeros(8, dtype=torch.float8_e4m3fn)).nbytes == 8


def test_as_view_refuses_non_contiguous_and_non_buffers() -> None:
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_view(np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="must be bytes-like"):
        as_view(12345)


def test_as_view_refuses_non_contiguous_tensor() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not contiguous"):
        as_view(torch.zeros(4, 4).t())


def test_serde_registry() -> None:
    naive = get_serde("naive")
    data = memoryview(b"abc")
    assert naive.deserialize(naive.serialize(data)) is data
    assert "naive" in supported_serdes()
    with pytest.raises(ConfigError, match=r"unknown remote_serde 'cachegen'; supported: naive"):
        get_serde("cachegen")
