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
from kvbucket.identity.manifest import read_identities  # noqa: E402
from kvbucket.integrations.transformers import KVBucketPrefixCache, probe_kv_layout  # noqa: E402
from kvbucket.stores.local.file import FileStore  # noqa: E402
from kvbucket.testing.identity_models import COMMITS  # noqa: E402

T = 16
CHUNKS = 3


def model(seed: int = 1, commit: str | None = None, rope_scaling: dict | None = None):  # type: ignore[no-untyped-def]
    """Built in memory (no files: the identity digests every parameter's bytes), or, with
    ``commit``, as if transformers had loaded it from that Hub revision (``_commit_hash``)."""
    m = build_model(TINY, seed=seed, name="org/tiny")
    if commit is not None:
        m.config._commit_hash = commit
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
        names = sorted(n for n in objects(root) if not n.startswith("_identity/"))
        assert len(names) == CHUNKS and all(split(n.split("@")[0])[1] == token for n in names)
    # the first writer of this identity recorded its manifest (what du shows)
    assert set(read_identities(FileStore(root), "", "org/tiny")) == {token}
    stored = objects(root)
    variants = {"weights": model(seed=2), "revision": model(commit=COMMITS[1]),
                "revision2": model(commit=COMMITS[0]),
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


def test_every_parameter_byte_counts_when_no_files_are_known() -> None:
    """A model built in memory: its identity digests every parameter's bytes, so one value of
    one tensor changed (a sample would miss it) is another identity."""
    from kvbucket.integrations.transformers_model import model_weights

    m = model()
    before = model_weights(m)
    assert before.startswith("tensors:") and model_weights(model()) == before
    name, p = sorted(m.named_parameters())[len(list(m.parameters())) // 2]
    with torch.no_grad():
        flat = p.view(-1)
        flat[flat.numel() // 2 + 1] += 1e-3  # one value, between any sample points
    assert model_weights(m) != before, name


def test_a_model_loaded_from_a_directory_is_named_by_its_files(tmp_path: Path) -> None:
    """``from_pretrained(dir)``: the identity's weights are the files' digest (the same as
    ``identity_of_dir``, kept per machine); the directory fine-tuned in place is another one."""
    from kvbucket.identity.core import identity_of_dir
    from kvbucket.integrations.transformers_model import model_weights
    from transformers import AutoModelForCausalLM

    d = tmp_path / "tiny"
    model().save_pretrained(d)
    loaded = AutoModelForCausalLM.from_pretrained(d)
    weights = model_weights(loaded)
    assert weights.startswith("files:") and weights == identity_of_dir(d).weights
    with torch.no_grad():
        next(iter(loaded.parameters())).view(-1)[3] += 1.0
    loaded.save_pretrained(d)  # rewritten in place
    assert model_weights(AutoModelForCausalLM.from_pretrained(d)) not in (weights, "")
