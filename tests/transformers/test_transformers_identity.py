"""The transformers prefix cache names chunks by the model's identity: the same model name with
other weights, another Hub revision or another ``rope_scaling`` misses every chunk and deletes
nothing; the same model built again (same weights, config and revision) hits every chunk."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvbucket.backends.remote import RemoteBackend  # noqa: E402
from kvbucket.demo.model import TINY, build_model  # noqa: E402
from kvbucket.identity.core import split  # noqa: E402
from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout  # noqa: E402
from kvbucket.stores.local.file import FileStore  # noqa: E402
from kvbucket.testing.identity_models import COMMITS  # noqa: E402

T = 16
CHUNKS = 3


def model(seed: int = 1, commit: str = COMMITS[0], rope_scaling: dict | None = None):  # type: ignore[no-untyped-def]
    m = build_model(TINY, seed=seed, name="org/tiny")
    m.config._commit_hash = commit  # as transformers sets it when it resolves a Hub revision
    if rope_scaling is not None:  # the same weights under another position scaling
        m.config.rope_scaling = rope_scaling
    return m


def objects(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_other_identity_misses_and_the_same_one_hits(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    ids = torch.randint(0, TINY.vocab_size, (1, CHUNKS * T + 3), generator=torch.Generator().manual_seed(5))
    first = model()
    layout = probe_kv_layout(first, T).to_kv_layout()

    def cache(m):  # type: ignore[no-untyped-def]
        return KVBucketPrefixCache(m, RemoteBackend(FileStore(root), layout), chunk_tokens=T)

    with cache(first) as c:
        c.prefill(ids)
        c.flush()
        token = c.identity.token
        names = sorted(objects(root))
        assert len(names) == CHUNKS and all(split(n.split("@")[0])[1] == token for n in names)
    stored = objects(root)
    variants = {"weights": model(seed=2), "revision": model(commit=COMMITS[1]),
                "rope": model(rope_scaling={"rope_type": "linear", "factor": 2.0})}  # fmt: skip
    for what, other in variants.items():
        with cache(other) as c:
            assert c.identity.token != token, what
            assert c.lookup(ids) == 0, what
            c.prefill(ids)
            assert c.last_stats.hit_tokens == 0, what
            c.flush()  # it stores its own chunks under its own identity
            assert {n: stored[n] for n in stored} == {n: objects(root)[n] for n in stored}, f"{what}: kept"
    with cache(model()) as c:  # the first model again: every chunk hits, the same bytes
        assert c.identity.token == token
        assert c.lookup(ids) == CHUNKS * T
        keys = c.chunk_keys(ids)
        got = c.backend.batched_get(keys)
        assert sorted(bytes(memoryview(g).cast("B")) for g in got) == sorted(stored[n][64:] for n in names)
        c.prefill(ids)
        assert c.last_stats.hit_tokens == CHUNKS * T
