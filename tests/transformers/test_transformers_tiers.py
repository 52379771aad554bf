"""Prefix reuse through the real tier stack: local_cpu -> local_disk -> remote, two "machines"."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import REGISTRY  # noqa: E402

from kvbucket.backends import HybridBackend, LocalCPUBackend, LocalDiskBackend, RemoteBackend  # noqa: E402
from kvbucket.demo.model import TINY, build_model  # noqa: E402
from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout  # noqa: E402
from kvbucket.metrics import InstrumentedBackend, InstrumentedStore  # noqa: E402
from kvbucket.stores import ObjectStore  # noqa: E402
from kvbucket.stores.local.file import FileStore  # noqa: E402

T = 32
GEN = {"max_new_tokens": 10, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}


def machine(remote_store: ObjectStore, local_dir: Path, layout: object, tag: str) -> HybridBackend:
    """One machine's stack; every tier instrumented under ``<tag>-<tier>``."""
    return HybridBackend([
        InstrumentedBackend(LocalCPUBackend(64 * 2**20), f"{tag}-cpu"),
        InstrumentedBackend(LocalDiskBackend(local_dir, 64 * 2**20), f"{tag}-disk"),
        InstrumentedBackend(
            RemoteBackend(remote_store, layout.to_kv_layout(), prefix="kv", owns_store=False),  # type: ignore[attr-defined]
            f"{tag}-remote",
        ),
    ])


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def cross_machine(tmp_path: Path, store: ObjectStore, tag: str) -> None:
    model = build_model(TINY, seed=3, name="tiny-tiers")
    layout = probe_kv_layout(model, T)
    doc = torch.randint(0, TINY.vocab_size, (1, 8 * T), generator=torch.Generator().manual_seed(1))
    qa = torch.randint(0, TINY.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    qb = torch.randint(0, TINY.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))

    a_backend = machine(store, tmp_path / "a-disk", layout, f"{tag}-a")
    with KVBucketPrefixCache(model, a_backend, chunk_tokens=T, salt="s") as a:
        a.generate(torch.cat([doc, qa], 1), **GEN)
    a_backend.close()
    assert metric("kvbucket_backend_operations_total", tier=f"{tag}-a-remote", op="put", result="ok") == 8

    b_backend = machine(store, tmp_path / "b-disk", layout, f"{tag}-b")  # empty local tiers
    ids = torch.cat([doc, qb], 1)
    with KVBucketPrefixCache(model, b_backend, chunk_tokens=T, salt="s") as b:
        out = b.generate(ids, **GEN)
        assert b.last_stats.hit_tokens == 8 * T
        nbytes = b.layout.nbytes
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert (out.logits[0] - ref.logits[0]).abs().max().item() < 1e-4
    remote = f"{tag}-b-remote"
    assert metric("kvbucket_backend_operations_total", tier=remote, op="get", result="hit") == 8
    assert metric("kvbucket_backend_bytes_total", tier=remote, direction="read") == 8 * nbytes
    # the hits were promoted into B's faster tiers, so a second prompt is served from memory
    assert metric("kvbucket_backend_bytes_total", tier=f"{tag}-b-cpu", direction="write") == 8 * nbytes
    with KVBucketPrefixCache(model, b_backend, chunk_tokens=T, salt="s") as b2:
        b2.prefill(ids)
        assert b2.last_stats.hit_tokens == 8 * T
    assert metric("kvbucket_backend_operations_total", tier=f"{tag}-b-cpu", op="get", result="hit") == 8
    assert metric("kvbucket_backend_operations_total", tier=remote, op="get", result="hit") == 8
    b_backend.close()


def test_cross_machine_hit_through_a_shared_directory(tmp_path: Path) -> None:
    store = InstrumentedStore(FileStore(tmp_path / "shared"), name="t-tiers-file")
    cross_machine(tmp_path, store, "t-file")
    # 8 chunks and the identity manifest machine A's tier recorded (issue 38), under _identity/
    assert metric("kvbucket_store_objects_total", store="t-tiers-file", op="put", result="ok") == 9
    names = [i.name for i in store.list("kv/")]
    assert len([n for n in names if "/_identity/" not in n]) == 8
    assert len([n for n in names if "/_identity/" in n]) == 1, names
    store.close()


def test_cross_machine_hit_through_a_hub_bucket(tmp_path: Path, hub_bucket) -> None:  # type: ignore[no-untyped-def]
    """The remote tier is a private bucket on the Hub emulator, driven by huggingface_hub/hf_xet."""
    from kvbucket.stores import open_store

    hub = hub_bucket.hub
    inner = open_store(f"hf://buckets/{hub_bucket.bucket_id}", endpoint=hub.endpoint, token=hub.write_token)
    store = InstrumentedStore(inner, name="t-tiers-hf")
    try:
        cross_machine(tmp_path, store, "t-hf")
        # 8 chunks and the identity manifest machine A's tier recorded (issue 38)
        assert metric("kvbucket_store_objects_total", store="t-tiers-hf", op="put", result="ok") == 9
        # 8 chunks and machine B's tier reading the identities recorded for its model (the manifest)
        assert metric("kvbucket_store_objects_total", store="t-tiers-hf", op="get", result="hit") == 9
    finally:
        store.close()
