"""A read path never deletes what is intact (issue 29 item 2, docs/integrity.md "What a reader may delete").

A reader whose store root is one level above the writer's (and reaches the writer's chunks
through a ``prefix``), or one level below (the writer used the prefix), sees every intact chunk
under another relative name. That is "not for this reader": a miss, counted as ``name``, and the
writer's chunk stays, on a directory, a Hub bucket (the emulator) and S3 (SeaweedFS). On main
before this the reader's ``contains`` was True, its ``get`` None, and the writer's chunk gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.metrics import integrity_failures as failures
from kvbucket.stores import open_store
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.backend_tests import chunk_bytes


def removed(tier: str, reason: str) -> float:
    """Objects one tier removed for one reason so far (``kvbucket_integrity_removed_total``)."""
    labels = {"tier": tier, "reason": reason}
    return REGISTRY.get_sample_value("kvbucket_integrity_removed_total", labels) or 0.0


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", chunk_tokens=8)

#: root -> a fresh store there ("" the top, "llama" one level below it)
Opener = Callable[[str], ObjectStore]


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("org/llama", 1, 0, 7000 + i, "bfloat16")


@pytest.fixture(params=["file", "hub", "s3"])
def at(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    if request.param == "file":
        yield lambda root: open_store(f"file://{tmp_path / 'R' / root}")
    elif request.param == "hub":
        hub_bucket = request.getfixturevalue("hub_bucket")
        yield lambda root: HFBucketStore(HFBucketConfig(
            bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/{root}".rstrip("/"),
            token=hub_bucket.hub.write_token, endpoint=hub_bucket.hub.endpoint, metadata_cache_ttl_secs=0))
    else:
        seaweedfs, bucket = request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket")
        yield lambda root: S3Store(S3Config.parse(seaweedfs.config(bucket, root)))


#: (writer's root, writer's prefix), (reader's root, reader's prefix): the same objects, other names
PLACES = {
    "reader-one-level-above": (("llama", ""), ("", "llama/")),
    "reader-one-level-below": (("", "llama/"), ("llama", "")),
}


@pytest.mark.parametrize("place", list(PLACES))
def test_a_reader_at_another_root_misses_and_leaves_the_writers_chunks(at: Opener, place: str) -> None:
    (w_root, w_prefix), (r_root, r_prefix) = PLACES[place]
    keys = [key(i) for i in range(3)]
    with RemoteBackend(at(w_root), LAYOUT, prefix=w_prefix) as w:
        w.batched_put([(k, chunk_bytes(LAYOUT, i)) for i, k in enumerate(keys)])
        w.flush()
    before, gone_before = failures("remote", "name"), removed("remote", "name")
    with RemoteBackend(at(r_root), LAYOUT, prefix=r_prefix, exists_cache_ttl_secs=0) as r:
        assert r.contains(keys[0])  # the object is there (a lookup reads no header) ...
        assert r.get(keys[0]) is None  # ... but its envelope binds it to the writer's name: a miss
        bufs = [np.zeros(LAYOUT.full_chunk_bytes, dtype=np.uint8) for _ in keys[1:]]
        assert r.batched_get_into(keys[1:], bufs) == [False, False]
        assert r.contains(keys[0])  # still there after the refused loads
    assert failures("remote", "name") == before + 3
    assert removed("remote", "name") == gone_before
    with at(w_root) as raw:
        assert all(raw.head(key_to_name(k, w_prefix)) is not None for k in keys)
    with RemoteBackend(at(w_root), LAYOUT, prefix=w_prefix) as w:
        assert [bytes(c) for c in w.batched_get(keys)] == [chunk_bytes(LAYOUT, i) for i in range(3)]


def test_a_chunk_copied_under_another_name_is_kept_and_damage_still_removed(tmp_path: Path) -> None:
    """The rule in one place: an intact envelope under another name is kept, a flipped byte removed."""
    from kvbucket.envelope import HEADER_SIZE
    from kvbucket.stores.local.file import FileStore

    with RemoteBackend(FileStore(tmp_path), LAYOUT) as w:
        w.batched_put([(key(i), chunk_bytes(LAYOUT, i)) for i in range(3)])
    raw = FileStore(tmp_path)
    raw.put(key_to_name(key(0)), raw.get(key_to_name(key(1))) or b"")  # copied under another name
    damaged = bytearray(raw.get(key_to_name(key(2))) or b"")
    damaged[HEADER_SIZE + 5] ^= 1
    raw.put(key_to_name(key(2)), damaged)
    with RemoteBackend(FileStore(tmp_path), LAYOUT) as r:
        assert r.get(key(0)) is None and r.get(key(2)) is None
        assert bytes(r.get(key(1))) == chunk_bytes(LAYOUT, 1)
    assert raw.exists(key_to_name(key(0))) and not raw.exists(key_to_name(key(2)))
