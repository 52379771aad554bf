"""Prefix KV reuse on a tiny 2-layer random Llama: correctness, the prefix rules, isolation, stores."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvbucket.demo.model import TINY, build_model  # noqa: E402
from kvbucket.errors import ConfigError, KVBucketError  # noqa: E402
from kvbucket.integrations.transformers import (  # noqa: E402
    KVBucketPrefixCache,
    UnsupportedModelError,
)
from kvbucket.testing.dict_backend import DictBackend  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402

T = 16  # tokens a chunk in these tests
GEN = {"max_new_tokens": 12, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
# First-token logits with a hit vs without: fp32 differs only by summation order.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 2e-2}


class GatedBackend(DictBackend):
    """Puts wait on an event: proves storing is off the critical path."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.put_started = threading.Event()

    def batched_put(self, items, blocking=True):  # type: ignore[no-untyped-def]
        self.put_started.set()
        assert self.release.wait(30), "test never released the gate"
        return super().batched_put(items, blocking)


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return build_model(TINY, seed=1, name="tiny-llama")


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def reference(model, ids):  # type: ignore[no-untyped-def]
    return model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)


def assert_same(ref, out, dtype=torch.float32) -> None:  # type: ignore[no-untyped-def]
    assert out.sequences.tolist() == ref.sequences.tolist()
    diff = (out.logits[0].float() - ref.logits[0].float()).abs().max().item()
    assert diff <= TOLERANCE[dtype], f"first-token logits differ by {diff}"


def test_identical_outputs_with_and_without_cache(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(5 * T + 7)
    ref = reference(model, ids)
    assert len(set(ref.sequences[0, ids.shape[1] :].tolist())) > 3, "degenerate model: outputs prove nothing"
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T) as cache:
        assert_same(ref, cache.generate(ids, **GEN))  # miss: computes everything, stores 5 chunks
        assert cache.last_stats.hit_tokens == 0
        cache.flush()
        assert cache.store_stats.stored == 5 and len(backend.data) == 5
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == 5 * T
        assert cache.last_stats.computed_tokens == 7
        assert cache.last_stats.bytes_loaded == 5 * cache.layout.nbytes
        assert_same(ref, out)


def test_prefill_then_model_generate(model) -> None:  # type: ignore[no-untyped-def]
    """The transformers-native form: a prefilled cache handed to model.generate."""
    ids = prompt(3 * T + 5, seed=3)
    ref = reference(model, ids)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T) as cache:
        cache.prefill(ids)
        cache.flush()
        past = cache.prefill(ids)
        assert cache.last_stats.hit_tokens == 3 * T
        assert past.get_seq_length() == ids.shape[1] - 1
        out = model.generate(ids, past_key_values=past, **GEN)  # no attention_mask: generate makes one
        assert_same(ref, out)
        past = cache.prefill(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=past, **GEN)
        assert_same(ref, out)


@pytest.mark.parametrize("n_chunks", [1, 4])
def test_prompt_of_whole_chunks_hits_fully(model, n_chunks: int) -> None:  # type: ignore[no-untyped-def]
    """Every token cached: generate() still gets one token to compute, and the output is unchanged."""
    ids = prompt(n_chunks * T, seed=4)
    ref = reference(model, ids)
    with KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T) as cache:
        cache.generate(ids, **GEN)
        cache.flush()
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == n_chunks * T and cache.last_stats.computed_tokens == 0
        assert_same(ref, out)


def test_short_prompt_has_no_chunks(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(T - 1, seed=5)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T) as cache:
        assert_same(reference(model, ids), cache.generate(ids, **GEN))
        cache.flush()
        assert backend.data == {} and cache.store_stats.queued == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dtypes(dtype: torch.dtype) -> None:
    model = build_model(TINY, seed=1, dtype=dtype, name="tiny-llama")
    ids = prompt(3 * T + 3, seed=6)
    ref = reference(model, ids)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T) as cache:
        assert cache.layout.dtype == dtype
        cache.generate(ids, **GEN)
        cache.flush()
        assert all(len(v) == cache.layout.nbytes for v in backend.data.values())
        assert cache.layout.nbytes == 2 * 2 * T * TINY.kv_heads * (TINY.hidden_size // TINY.heads) * 2
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == 3 * T
        assert_same(ref, out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_layout_is_lmcache_order(dtype: torch.dtype) -> None:
    """Stored bytes are (layers, 2, tokens, kv_heads, head_size) of the model's own KV."""
    model = build_model(TINY, seed=1, dtype=dtype, name="tiny-llama")
    ids = prompt(2 * T + 1, seed=7)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T) as cache:
        cache.prefill(ids)
        cache.flush()
        blobs = [backend.data[k.to_string()] for k in cache.chunk_keys(ids)]
    with torch.no_grad():
        kv = model(ids[:, : 2 * T], use_cache=True).past_key_values
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # a 2T-token forward vs the prefill's 2T+1
    for i, blob in enumerate(blobs):
        stored = torch.frombuffer(bytearray(blob), dtype=dtype).reshape(cache.layout.shape)
        for layer in range(TINY.layers):
            keys = kv.layers[layer].keys[0, :, i * T : (i + 1) * T].transpose(0, 1)
            values = kv.layers[layer].values[0, :, i * T : (i + 1) * T].transpose(0, 1)
            torch.testing.assert_close(stored[layer, 0], keys, rtol=0, atol=atol)
            torch.testing.assert_close(stored[layer, 1], values, rtol=0, atol=atol)


def test_longest_prefix_stops_at_first_miss(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(6 * T, seed=8)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T, fetch_window=2) as cache:
        cache.prefill(ids)
        cache.flush()
        keys = cache.chunk_keys(ids)
        assert len(keys) == 6 and len(backend.data) == 6
        backend.remove(keys[2])  # chunks 3, 4, 5 are stored but unusable after the hole
        assert cache.lookup(ids) == 2 * T
        backend.gets = 0
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == 2 * T
        assert backend.gets == 4, "fetched windows past the one holding the first miss"
        assert_same(reference(model, ids), out)
        cache.flush()
        assert keys[2].to_string() in backend.data  # the hole was refilled in the background


def test_partial_hit_when_the_middle_changes(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(6 * T + 4, seed=9)
    changed = ids.clone()
    changed[0, 3 * T + 5] = (changed[0, 3 * T + 5] + 1) % TINY.vocab_size  # inside chunk 3
    with KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T) as cache:
        cache.prefill(ids)
        cache.flush()
        a, b = cache.chunk_keys(ids), cache.chunk_keys(changed)
        assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:], strict=True))
        out = cache.generate(changed, **GEN)
        assert cache.last_stats.hit_tokens == 3 * T
        assert_same(reference(model, changed), out)


def test_same_chunk_after_a_different_prefix_is_a_different_key(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(2 * T, seed=10)
    swapped = torch.cat([prompt(T, seed=11), ids[:, T:]], dim=1)
    with KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T) as cache:
        assert cache.chunk_keys(ids)[1] != cache.chunk_keys(swapped)[1]


def test_isolation_by_salt_model_and_dtype(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(4 * T + 2, seed=12)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T, salt="tenant-a") as cache:
        cache.prefill(ids)
        cache.flush()
        assert cache.lookup(ids) == 4 * T
        key = cache.chunk_keys(ids)[0]
        # the model's name with its identity (kvbucket.identity): other weights, other names
        assert key.model_name == f"tiny-llama~{cache.identity.token}" and key.dtype == "float32"
    with KVBucketPrefixCache(model, backend, chunk_tokens=T, salt="tenant-b") as other_salt:
        assert other_salt.lookup(ids) == 0
    same_name_other_weights = build_model(TINY, seed=2, name="tiny-llama")
    with KVBucketPrefixCache(same_name_other_weights, backend, chunk_tokens=T, salt="tenant-a") as other:
        assert other.lookup(ids) == 0
        out = other.generate(ids, **GEN)
        assert other.last_stats.hit_tokens == 0
        assert_same(reference(same_name_other_weights, ids), out)
    bf16 = build_model(TINY, seed=1, dtype=torch.bfloat16, name="tiny-llama")
    with KVBucketPrefixCache(bf16, backend, chunk_tokens=T, salt="tenant-a") as other_dtype:
        assert other_dtype.lookup(ids) == 0
    with KVBucketPrefixCache(model, backend, chunk_tokens=2 * T, salt="tenant-a") as other_chunking:
        assert other_chunking.lookup(ids) == 0


def test_wrong_size_chunk_is_a_miss_not_corruption(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(3 * T + 1, seed=13)
    backend = DictBackend()
    with KVBucketPrefixCache(model, backend, chunk_tokens=T, store=False) as cache:
        keys = cache.chunk_keys(ids)
        good = KVBucketPrefixCache(model, backend, chunk_tokens=T)
        good.prefill(ids)
        good.close()
        backend.data[keys[1].to_string()] = backend.data[keys[1].to_string()][:-4]
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == T
        assert cache.store_stats.queued == 0  # store=False: read-only
        assert_same(reference(model, ids), out)


def test_stores_happen_off_the_critical_path(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(4 * T + 1, seed=14)
    backend = GatedBackend()
    cache = KVBucketPrefixCache(model, backend, chunk_tokens=T)
    try:
        out = cache.generate(ids, **GEN)  # returns although every put is blocked
        assert out.sequences.shape[1] == ids.shape[1] + GEN["max_new_tokens"]
        assert backend.put_started.wait(10)
        assert cache.store_stats.queued == 4 and cache.store_stats.stored == 0
        assert backend.data == {}
        assert cache.flush(timeout=0.2) is False
    finally:
        backend.release.set()
        cache.close()  # flushes
    assert cache.store_stats.stored == 4 and len(backend.data) == 4


def test_failed_store_is_counted_not_stored(model) -> None:  # type: ignore[no-untyped-def]
    class Failing(DictBackend):
        def put(self, key, chunk, blocking=True):  # type: ignore[no-untyped-def]
            raise OSError("disk full")

    with KVBucketPrefixCache(model, Failing(), chunk_tokens=T) as cache:
        cache.generate(prompt(2 * T + 1, seed=15), **GEN)
        cache.flush()
        assert cache.store_stats.failed == 2 and cache.store_stats.stored == 0


def test_refuses_what_it_cannot_serve(model) -> None:  # type: ignore[no-untyped-def]
    cache = KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T)
    with pytest.raises(UnsupportedModelError, match="batch size 2"):
        cache.prefill(prompt(2 * T).repeat(2, 1))
    with pytest.raises(UnsupportedModelError, match="padding"):
        ids = prompt(T)
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        cache.generate(ids, attention_mask=mask, max_new_tokens=1)
    with pytest.raises(ConfigError, match="empty"):
        cache.prefill([])
    with pytest.raises(ConfigError, match="past_key_values"):
        cache.generate(prompt(T), past_key_values=object())
    model.train()
    try:
        with pytest.raises(UnsupportedModelError, match=r"model\.eval\(\)"):
            cache.prefill(prompt(T))
    finally:
        model.eval()
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVBucketPrefixCache(model, DictBackend(), chunk_tokens=0)
    with pytest.raises(ConfigError, match="StorageBackend"):
        KVBucketPrefixCache(model, {}, chunk_tokens=T)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'@'"):
        KVBucketPrefixCache(model, DictBackend(), model_id="org@model")
    cache.close()
    with pytest.raises(KVBucketError, match="closed"):
        cache.prefill(prompt(T))


def test_refuses_sliding_window_models() -> None:
    config = MistralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64, sliding_window=8,
    )
    model = MistralForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="sliding"):
        KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T)


def test_accepts_token_lists(model) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(2 * T + 3, seed=16)
    with KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T) as cache:
        as_list = ids[0].tolist()
        assert cache.chunk_keys(as_list) == cache.chunk_keys(ids) == cache.chunk_keys([as_list])
        past = cache.prefill(ids[0].tolist())
        assert past.get_seq_length() == ids.shape[1] - 1


def test_importing_kvbucket_does_not_import_torch() -> None:
    code = (
        "import sys, kvbucket, kvbucket.metrics, kvbucket.cli; kvbucket.cli.build_app(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _gpt2() -> object:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512, initializer_range=0.2,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def _qwen2() -> object:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=128, vocab_size=256, initializer_range=0.2, use_sliding_window=False,
        sliding_window=32,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_gpt2, _qwen2], ids=["gpt2-no-kv-head-fields", "qwen2-mqa"])
def test_other_architectures(make) -> None:  # type: ignore[no-untyped-def]
    """GPT-2's config has no num_key_value_heads/head_dim (the probe learns them); Qwen2 with one KV
    head and a sliding_window it does not use is a full-attention model and is served."""
    model = make()
    ids = prompt(4 * T + 6, seed=17)
    ref = reference(model, ids)
    with KVBucketPrefixCache(model, DictBackend(), chunk_tokens=T) as cache:
        cache.generate(ids, **GEN)
        cache.flush()
        out = cache.generate(ids, **GEN)
        assert cache.last_stats.hit_tokens == 4 * T
        assert_same(ref, out)
