"""Pages written from and read into a strided tensor's own regions (no staging copy), sealed.

The SGLang integration moves host-pool pages this way (:mod:`kvbucket.integrations.tensor_regions`,
``Gather`` writes, multi-region ``Scatter`` reads through :class:`SealedStore`); these checks need
only torch, so they run in the main venv on a directory store and the in-memory store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbucket.errors import StoreError
from kvbucket.integrations.tensor_regions import StorageViews
from kvbucket.stores.base import Gather, Scatter
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore


def pool() -> torch.Tensor:
    """A layer-first KV buffer like SGLang's: (k/v, layers, tokens, heads, head_dim)."""
    return torch.randn(2, 3, 64, 2, 8).to(torch.bfloat16)


def page(buf: torch.Tensor, start: int) -> torch.Tensor:
    return buf[:, :, start : start + 16]


def test_regions_are_the_pages_bytes_in_order() -> None:
    buf = pool()
    views = StorageViews()
    regs = views.regions(page(buf, 16))
    assert regs is not None and len(regs) == 6  # 2 x 3 layers, 16 tokens x 2 x 8 each
    assert b"".join(bytes(r) for r in regs) == page(buf, 16).contiguous().view(torch.uint8).numpy().tobytes()
    whole = views.regions(buf)
    assert whole is not None and len(whole) == 1 and whole[0].nbytes == buf.numel() * 2
    assert views.regions(page(buf, 0), max_regions=5) is None  # too many: the caller stages


@pytest.mark.parametrize("kind", ["dir", "memory"])
def test_gather_write_scatter_read_round_trip_and_damage_is_a_miss(tmp_path: Path, kind: str) -> None:
    raw = FileStore(tmp_path) if kind == "dir" else MemoryStore()
    store = seal_store(raw, tier="test")
    src, dst = pool(), torch.zeros(2, 3, 64, 2, 8, dtype=torch.bfloat16)
    views = StorageViews()
    items = [(f"m/p{i}", Gather(*views.regions(page(src, 16 * i)))) for i in range(4)]
    assert [r.size for r in store.put_many(items)] == [6 * 16 * 2 * 8 * 2] * 4
    # Stored as the flat page (the format a contiguous copy of the page has), in an envelope.
    flat = bytearray(page(src, 0).numel() * 2)
    (r,) = store.get_many(["m/p0"], [flat])
    assert r.found and bytes(flat) == page(src, 0).contiguous().view(torch.uint8).numpy().tobytes()
    targets = [Scatter(*views.regions(page(dst, 16 * i))) for i in range(4)]
    got = store.get_many([n for n, _ in items], targets)
    assert all(g.found for g in got) and torch.equal(dst.view(torch.uint8), src.view(torch.uint8))

    blob = bytearray(raw.get("m/p2"))
    blob[len(blob) // 2] ^= 0xFF
    raw.put("m/p2", bytes(blob))
    (bad,) = store.get_many(["m/p2"], [Scatter(*views.regions(page(dst, 32)))])
    assert not bad.found and bad.error is None  # a miss, and the damaged object is gone
    assert raw.head("m/p2") is None


def test_encrypted_stores_join_gathers_and_refuse_region_reads(tmp_path: Path) -> None:
    from kvbucket.encryption import Keyring

    store = seal_store(FileStore(tmp_path), tier="test", encryption=Keyring({"*": {1: bytes(32)}}))
    src = pool()
    views = StorageViews()
    (r,) = store.put_many([("m/p0", Gather(*views.regions(page(src, 0))))])
    assert r.error is None
    out = bytearray(page(src, 0).numel() * 2)
    (g,) = store.get_many(["m/p0"], [out])
    assert g.found and bytes(out) == page(src, 0).contiguous().view(torch.uint8).numpy().tobytes()
    with pytest.raises(StoreError, match=r"buffer given for 'm/p0'"):
        store.get_many(["m/p0"], [Scatter(*views.regions(page(pool(), 0)))])
