"""The transformers prefix cache over a hung remote tier: a prefill costs the store's lookup
deadline (1 s by default, HF and S3), then generation proceeds and equals the no-cache output;
once the store's breaker is open the remote tier costs nothing (docs/reliability.md)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvbucket.backends import HybridBackend, LocalCPUBackend, RemoteBackend  # noqa: E402
from kvbucket.demo.model import TINY, build_model  # noqa: E402
from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout  # noqa: E402
from kvbucket.stores import ObjectStore  # noqa: E402
from kvbucket.stores.guard.breaker import OPEN  # noqa: E402
from kvbucket.stores.hub.config import build_config  # noqa: E402
from kvbucket.stores.hub.store import HFBucketStore  # noqa: E402
from kvbucket.stores.s3.config import S3Config  # noqa: E402
from kvbucket.stores.s3.store import S3Store  # noqa: E402
from kvbucket.testing.silent_server import SilentServer  # noqa: E402

T = 32
GEN = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}


def hung_store(kind: str, url: str) -> tuple[ObjectStore, float]:
    """A store on a server that never answers, default read deadlines; returns it and the
    deadline a prefill's load pays: the lookup budget, 1 s (HF: the metadata lookup; S3: no
    response headers within s3_lookup_timeout_secs), not the 5 s load budget."""
    if kind == "hf":
        cfg = build_config(bucket_handle="hf://buckets/o/b", token="hf_x", token_env="", endpoint=url,
                           store_timeout_secs=2.0, breaker_failures=2)
        return HFBucketStore(cfg), cfg.lookup_timeout_secs
    s3 = S3Config.parse({"s3_endpoint": "s3://bucket", "s3_endpoint_url": url, "s3_region": "us-east-1",
                         "aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "not-a-secret",
                         "s3_store_timeout_secs": 2.0, "s3_breaker_failures": 2})
    return S3Store(s3), s3.s3_lookup_timeout_secs


@pytest.mark.parametrize("kind", ["hf", "s3"])
def test_a_hung_remote_tier_costs_its_deadline_then_generation_equals_no_cache(kind: str) -> None:
    model = build_model(TINY, seed=3, name=f"tiny-hung-{kind}")
    layout = probe_kv_layout(model, T)
    ids = torch.randint(0, TINY.vocab_size, (1, 4 * T + 5), generator=torch.Generator().manual_seed(7))
    t0 = time.monotonic()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
    compute = time.monotonic() - t0
    with SilentServer() as server:
        store, deadline = hung_store(kind, server.url)
        remote = RemoteBackend(store, layout.to_kv_layout(), prefix="kv")
        backend = HybridBackend([LocalCPUBackend(64 * 2**20), remote])
        try:
            with KVBucketPrefixCache(model, backend, chunk_tokens=T, salt="s") as cache:
                t0 = time.monotonic()
                out = cache.generate(ids, **GEN)
                took = time.monotonic() - t0
                assert cache.last_stats.hit_tokens == 0
                assert out.sequences.tolist() == ref.sequences.tolist()
                assert (out.logits[0] - ref.logits[0]).abs().max().item() < 1e-4
                print(f"{kind}: prefill+generate {took:.2f}s, no-cache compute {compute:.2f}s")
                # slack for a loaded 2-core box (seen: 4.0 s against a 3.6 s bound at load 12)
                assert took < deadline + 3 * compute + 2.0  # S3 was: its 5 s load budget, then compute
            # Closing drained the queued stores: they failed at their deadline and opened the breaker.
            assert store.breaker.state is OPEN
            seed8 = torch.Generator().manual_seed(8)
            other = torch.randint(0, TINY.vocab_size, (1, 4 * T + 5), generator=seed8)
            ref2 = model.generate(other, attention_mask=torch.ones_like(other), **GEN)
            with KVBucketPrefixCache(model, backend, chunk_tokens=T, salt="s", store=False) as cache:
                t0 = time.monotonic()
                out = cache.generate(other, **GEN)
                took = time.monotonic() - t0
                assert out.sequences.tolist() == ref2.sequences.tolist()
                assert took < 3 * compute + 1.0  # the open breaker answers at once
        finally:
            backend.close()
            store.close()


def test_close_is_bounded_while_stores_hang() -> None:
    """close(timeout) returns at its bound while the store worker is stuck on a hung store: the
    chunks still queued are dropped and counted, the stuck batch is left to its deadline (was:
    close() waited for every queued store: two batches of 2 s each here)."""
    model = build_model(TINY, seed=3, name="tiny-hung-close")
    layout = probe_kv_layout(model, T)
    ids = torch.randint(0, TINY.vocab_size, (1, 20 * T + 5), generator=torch.Generator().manual_seed(9))
    with SilentServer() as server:
        store = HFBucketStore(build_config(bucket_handle="hf://buckets/o/b", token="hf_x", token_env="",
                                           endpoint=server.url, store_timeout_secs=2.0, breaker_failures=0))
        remote = RemoteBackend(store, layout.to_kv_layout(), prefix="kv", blocking_timeout_secs=60)
        try:
            cache = KVBucketPrefixCache(model, remote, chunk_tokens=T, salt="s")
            cache.prefill(ids)  # 20 chunks queued; the worker takes up to 16 into one stuck batch
            t0 = time.monotonic()
            cache.close(timeout=0.5)
            assert time.monotonic() - t0 < 2.0
            stats = cache.store_stats
            assert stats.queued == 20 and stats.stored == 0 and stats.dropped >= 4
        finally:
            remote.close()
            store.close()
