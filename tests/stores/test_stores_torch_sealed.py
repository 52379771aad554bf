"""CPU torch tensors as load buffers through the sealing layer (issue 41's second tester, E):
sealed and encrypted stores read into a tensor of any dtype and shape as raw stores do (they
refused every tensor: "memoryview: a bytes-like object is required, not 'Tensor'", so
``RemoteBackend.batched_get_into`` with a torch chunk always missed); a tensor whose memory does
not hold what it shows (a lazy conjugate view) is a kvbucket error, never a bare torch one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbucket.encryption import Keyring
from kvbucket.errors import KVBucketError
from kvbucket.stores import open_store
from kvbucket.stores.guard.sealed import seal_store

torch = pytest.importorskip("torch")

N = (1 << 20) + 8  # on the Hub, read in parts (read_part_bytes below); divisible by 8 (2-D bf16, complex64)


def _buffers() -> dict[str, Any]:
    return {
        "u8": torch.zeros(N, dtype=torch.uint8),
        "bf16": torch.zeros(N // 2, dtype=torch.bfloat16),
        "bf16 2-D": torch.zeros(4, N // 8, dtype=torch.bfloat16),
        "bf16 slice": torch.zeros(N // 2 + 10, dtype=torch.bfloat16)[5 : 5 + N // 2],
    }


def _bytes(t: Any) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("encrypted", [False, True], ids=["sealed", "encrypted"])
@pytest.mark.parametrize("kind", ["memory", "dir", "hub"])
def test_sealed_stores_read_into_torch_tensors(tmp_path: Path, request: pytest.FixtureRequest, kind: str,
                                               encrypted: bool) -> None:
    if kind == "memory":
        url, options = f"memory://torch-sealed-{os.getpid()}-{encrypted}", {}
    elif kind == "dir":
        url, options = str(tmp_path / "store"), {}
    else:
        hub = request.getfixturevalue("hub_bucket")
        target = {"url": f"hf://buckets/{hub.bucket_id}",
                  "options": {"token": hub.hub.write_token, "endpoint": hub.hub.endpoint, "token_env": "",
                              "retry_backoff_secs": 0.01}}
        url = target["url"]
        options = {**target["options"], "read_part_bytes": 256 << 10, "read_min_part_bytes": 65536}
    ring = Keyring({"*": {1: os.urandom(32)}}) if encrypted else None
    data = np.random.default_rng(41).integers(0, 256, N, dtype=np.uint8)
    with open_store(url, **options) as raw:
        store = seal_store(raw, tier="remote", encryption=ring)
        assert store.put_many([("x", data)])[0].ok
        for label, buf in _buffers().items():
            (r,) = store.get_many(["x"], [buf])
            assert r.error is None and r.found, (label, r.error)
            assert _bytes(buf) == data.tobytes(), label
        wrong = torch.zeros(N // 2 - 1, dtype=torch.bfloat16)
        (r,) = store.get_many(["x"], [wrong])
        assert not r.found and r.error is not None, r
        assert not wrong.any()  # a refused buffer is left untouched
        conj = torch.zeros(N // 8, dtype=torch.complex64).conj()
        with pytest.raises(KVBucketError, match=r"buffer given for 'x'.*conjugate"):
            store.get_many(["x"], [conj])


def test_raw_stores_refuse_a_conjugate_tensor_with_a_kvbucket_error(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "raw")) as store:
        store.put_many([("x", bytes(64))])
        with pytest.raises(KVBucketError, match=r"buffer given for 'x'.*conjugate"):
            store.get_many(["x"], [torch.zeros(8, dtype=torch.complex64).conj()])
        neg = torch.zeros(8, dtype=torch.complex64).conj().imag  # a negative view (and strided)
        with pytest.raises(KVBucketError, match=r"buffer given for 'x'"):
            store.get_many(["x"], [neg])


def test_remote_backend_get_into_a_torch_chunk_hits(tmp_path: Path) -> None:
    """docs/backends.md: a chunk may be a CPU torch tensor; the backend seals on write and
    verifies on read, so the load goes through the sealing layer."""
    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.chunks import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=16)
    backend = RemoteBackend(open_store(str(tmp_path / "remote")), layout)
    chunk = torch.randn(layout.shape).to(torch.bfloat16)
    key = "vllm@m@1@0@abcdef01"
    assert backend.batched_put([(key, chunk)]) == 1
    buf = torch.zeros(layout.shape, dtype=torch.bfloat16)
    assert backend.batched_get_into([key], [buf]) == [True]
    assert _bytes(buf) == _bytes(chunk)
