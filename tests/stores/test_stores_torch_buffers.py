"""CPU torch tensors as load buffers on every store family (issue 41's tester, case_torch and
case_hub_torch): an exact-size tensor of any dtype is read into; a wrong-size or non-contiguous
one is that item's SizeMismatchError (it was a TypeError out of ``get_many`` for the whole batch,
and on the Hub even an exact-size tensor was refused); a buffer that cannot be written (not
contiguous, as read-only ones) is a ValueError naming the item, as before, never a TypeError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbucket.errors import InvalidKeyError, SizeMismatchError
from kvbucket.stores import open_store
from kvbucket.testing.engines import store_targets

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("kind", ["dir", "hub", "s3"])
def test_torch_tensors_are_load_buffers_and_their_faults_are_per_item(
        tmp_path: Path, hub_bucket: Any, seaweedfs: Any, s3_bucket: str, kind: str) -> None:
    target = store_targets(tmp_path, hub_bucket, seaweedfs, s3_bucket)[kind]
    data = np.random.default_rng(41).integers(0, 256, 1 << 20, dtype=np.uint8)  # ranged on S3 (2 x 512 KiB)
    options = dict(target.get("options", {}))
    if kind == "s3":
        options["s3_read_part_bytes"] = 512 << 10
    with open_store(target["url"] + "/torch41", **options) as store:
        assert store.put_many([("t", data), ("u", data)])[0].ok
        exact = torch.zeros(1 << 19, dtype=torch.bfloat16)
        small = torch.zeros((1 << 19) - 1, dtype=torch.bfloat16)
        strided = torch.zeros(1 << 20, dtype=torch.bfloat16)[::2]
        ok, short = store.get_many(["t", "u"], [exact, small])
        assert ok.error is None and exact.view(torch.uint8).numpy().tobytes() == data.tobytes()
        assert isinstance(short.error, SizeMismatchError), short.error
        with pytest.raises(InvalidKeyError, match=r"buffer given for 't'.*not contiguous"):
            store.get_many(["t"], [strided])
