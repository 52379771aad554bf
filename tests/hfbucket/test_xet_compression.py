"""Which compression policy a batch of Hub uploads takes (xet_compression.batch_policy).

With the ``auto`` setting a batch whose sampled objects do not compress (random bytes,
ciphertext) goes up with ``none``, skipping hf_xet's per-chunk LZ4 attempts; anything that
compresses, and anything too small or odd to sample, is left to hf_xet's ``auto``. Which
policy a real upload took, and that both read back, is in test_upload_commits.py and
test_hfbucket_store.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvbucket.encryption import Keyring
from kvbucket.stores.base import Gather
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.xet import compression as xet_compression
from kvbucket.stores.hub.xet.compression import batch_policy
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.payloads import payload, realistic_kv

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_policy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_XET_XORB_COMPRESSION_POLICY", raising=False)


def _random(n: int, size: int = 2 * MiB) -> list[np.ndarray]:
    return [payload("random", size, f"r{i}") for i in range(n)]


def _kv(n: int, size: int = 2 * MiB) -> list[np.ndarray]:
    return [realistic_kv(size, f"k{i}") for i in range(n)]


def test_random_bytes_go_up_uncompressed_and_kv_is_left_to_hf_xet() -> None:
    assert batch_policy("auto", _random(64)) == "none"
    assert batch_policy("auto", _kv(64)) == "auto"  # bf16 KV shrinks to ~0.9 after byte grouping


def test_an_encrypted_stores_objects_go_up_uncompressed() -> None:
    """Ciphertext of KV that would compress does not: every object of an encrypted store."""
    sealed = seal_store(MemoryStore(), tier="l2", encryption=Keyring({"*": {1: os.urandom(32)}}))
    plain = _kv(4)
    assert batch_policy("auto", plain) == "auto"
    assert batch_policy("auto", [sealed.seal(f"k{i}", kv) for i, kv in enumerate(plain)]) == "none"


@pytest.mark.parametrize("where", [0, 32, 63])
def test_one_sampled_object_that_compresses_keeps_hf_xets_auto(where: int) -> None:
    batch = _random(64)
    batch[where] = realistic_kv(2 * MiB, "odd one")
    assert batch_policy("auto", batch) == "auto"


def test_text_and_constant_bytes_compress() -> None:
    text = np.frombuffer((b"the same prompt, again and again. " * 70_000)[: 2 * MiB], np.uint8)
    assert batch_policy("auto", [text] * 3) == "auto"
    assert batch_policy("auto", [np.zeros(2 * MiB, np.uint8)]) == "auto"


def test_what_cannot_be_sampled_is_left_to_hf_xet() -> None:
    assert batch_policy("auto", []) == "auto"
    assert batch_policy("auto", _random(3, size=4096)) == "auto"  # too small to guess from
    strided = np.frombuffer(os.urandom(8 * MiB), np.uint8)[::2]  # not one contiguous buffer
    assert batch_policy("auto", [strided]) == "auto"


@pytest.mark.parametrize("setting", ["none", "lz4", "bg4-lz4"])
def test_any_other_setting_is_used_as_given(setting: str) -> None:
    assert batch_policy(setting, _kv(2)) == setting
    assert batch_policy(setting, _random(2)) == setting


def test_hf_xets_own_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_XET_XORB_COMPRESSION_POLICY", "bg4-lz4")
    assert batch_policy("auto", _random(3)) == "auto"  # the session then takes hf_xet's setting


def test_a_sealed_objects_header_is_not_made_by_the_sample() -> None:
    """A sealed object's header (its payload's checksum) is made when the upload reads it
    (Gather.headed), not by the sample; the sample reads the payload, not the header."""
    made: list[int] = []

    def head(parts: tuple[memoryview, ...]) -> bytes:
        made.append(1)
        return bytes(64)

    batch = [Gather.headed(64, head, r) for r in _random(3)]
    assert batch_policy("auto", batch) == "none"
    assert made == []
    assert batch[0].sample(xet_compression.SAMPLE_BYTES).nbytes == xet_compression.SAMPLE_BYTES
    kv = [Gather.headed(64, head, k) for k in _kv(3)]
    assert batch_policy("auto", kv) == "auto"
    assert made == []


def test_a_sample_that_compresses_only_after_byte_grouping_counts() -> None:
    """bf16 KV does not shrink under LZ4 alone (its mantissa bytes look random): without the
    byte-grouped attempt it would go up raw and cost 10% more bytes on every load."""
    import lz4.block

    kv = realistic_kv(2 * MiB, "bg4")
    mid = memoryview(kv)[MiB : MiB + xet_compression.SAMPLE_BYTES]
    assert len(lz4.block.compress(mid, store_size=False)) >= xet_compression.INCOMPRESSIBLE * mid.nbytes
    assert xet_compression.compresses(mid)
