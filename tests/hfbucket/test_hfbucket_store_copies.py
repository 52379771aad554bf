"""The copies a store makes of a payload on its way to the bucket (issue 23: a store at 0 ms at
least as fast as LMCache's hfbucket adapter).

Below 1 MiB (these tests' objects), hf_xet's ``start_upload_bytes`` takes ``bytes``, so one copy
is needed (larger objects go by a file in RAM: test_hfbucket_upload_staging.py). The sealing
layer hashes the caller's buffer where it lies and hands the bucket store header + payload as a
``Gather``; the upload joins each object just before handing it over. Before, the payload was
copied twice (into the sealed blob, then into ``bytes``), all objects before the first was
handed over.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import xxhash

from kvbucket import envelope as env
from kvbucket.stores.base import Gather
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.hub.xet import uploads as xet_uploads
from kvbucket.stores.local.file import FileStore
from kvbucket.stores.local.memory import MemoryStore
from kvbucket.testing.hub_emulator.request_log import count_routes


def test_sealed_payloads_reach_the_uploader_uncopied_and_are_joined_once_each(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = hub_bucket.hub
    rng = np.random.default_rng()
    data = [rng.integers(0, 256, 300_000 + i, dtype=np.uint8) for i in range(5)]
    names = [f"k{i}" for i in range(len(data))]
    handed: list[tuple[str, Any]] = []
    joined: list[bytes | bytearray] = []
    as_bytes = xet_uploads.upload_bytes

    def spy_join(d: Any, reuse: bytearray | None = None) -> bytes | bytearray:
        joined.append(bytes(as_bytes(d, reuse)))  # a copy: a joined buffer may be reused
        return joined[-1]

    monkeypatch.setattr(xet_uploads, "upload_bytes", spy_join)
    with HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/c-{uuid.uuid4().hex[:6]}", token=hub.write_token,
        endpoint=hub.endpoint, token_env="", retry_backoff_secs=0.01,
    )) as raw:
        put = raw.put_many
        monkeypatch.setattr(raw, "put_many", lambda items: handed.extend(items) or put(items))
        store = seal_store(raw, tier="test")
        hub.emulator.requests(clear=True)
        results = store.put_many(list(zip(names, data, strict=True)))
        assert [r.size for r in results] == [d.nbytes for d in data]
        # The bucket store got the caller's arrays themselves, behind a 64-byte header.
        assert [type(x) for _, x in handed] == [Gather] * len(data)
        assert all(g.parts[1].obj is d for (_, g), d in zip(handed, data, strict=True))
        assert all(g.parts[0].nbytes == env.HEADER_SIZE for _, g in handed)
        # One join per object: exactly the envelope hf_xet stores.
        assert [len(b) for b in joined] == [env.HEADER_SIZE + d.nbytes for d in data]
        assert all(bytes(b[env.HEADER_SIZE :]) == d.tobytes() for b, d in zip(joined, data, strict=True))
        routes = count_routes(hub.emulator.requests(clear=True))
        assert routes.get("batch") == 1 and routes.get("shard_upload") == 1, routes  # one commit
        outs = [np.zeros_like(d) for d in data]
        assert all(r.found for r in store.get_many(names, outs))
        assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_as_bytes_copies_only_what_hf_xet_would_read_item_by_item() -> None:
    whole = b"x" * 1000
    assert xet_uploads.upload_bytes(whole) is whole
    assert xet_uploads.upload_bytes(memoryview(whole)) is whole
    arr = bytearray(b"y" * 10)
    assert xet_uploads.upload_bytes(arr) is arr
    part = xet_uploads.upload_bytes(memoryview(whole)[10:20])
    assert type(part) is bytearray and part == b"x" * 10
    a = np.arange(12, dtype=np.uint16)
    assert xet_uploads.upload_bytes(a) == a.tobytes()
    g = Gather(b"head", a)
    assert xet_uploads.upload_bytes(g) == b"head" + a.tobytes()
    scratch = bytearray(28)
    assert xet_uploads.upload_bytes(g, reuse=scratch) is scratch and scratch == b"head" + a.tobytes()
    other = xet_uploads.upload_bytes(a, reuse=scratch)  # another size: a new buffer, scratch untouched
    assert other is not scratch and other == a.tobytes() and scratch == b"head" + a.tobytes()
    assert xet_uploads.upload_bytes(arr, reuse=bytearray(10)) is arr  # a caller's bytearray: as it is


@pytest.mark.parametrize("kind", ["dir", "memory"])
def test_other_stores_get_one_copy_or_none(tmp_path: Any, kind: str) -> None:
    """A directory gathers (header + the caller's buffer, one writev); a store that does not
    gets one new buffer, the one copy (made by numpy, without the GIL), which S3's client takes
    as it is."""
    raw = FileStore(tmp_path) if kind == "dir" else MemoryStore()
    store = seal_store(raw, tier="test")
    src = np.random.default_rng().integers(0, 256, 70_000, dtype=np.uint8)
    blob = store.seal("m/x", src)
    if kind == "dir":
        assert isinstance(blob, Gather) and blob.parts[1].obj is src
    else:
        assert isinstance(blob, np.ndarray) and blob.flags.c_contiguous and not np.shares_memory(blob, src)
        assert blob.nbytes == env.HEADER_SIZE + src.nbytes
        assert blob[env.HEADER_SIZE :].tobytes() == src.tobytes()
    (r,) = store.put_many([("m/x", src)])
    assert r.size == src.nbytes
    out = np.zeros_like(src)
    (g,) = store.get_many(["m/x"], [out])
    assert g.found and np.array_equal(out, src)


def test_each_object_is_hashed_when_the_uploader_takes_it(
    hub_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal hands the bucket store Gathers whose header (the payload's checksum) is made
    when the upload first reads them, one object at a time: when object i is joined, the later
    objects are not hashed yet. The stored envelope is the one an eager seal makes."""
    hub = hub_bucket.hub
    rng = np.random.default_rng()
    data = [rng.integers(0, 256, 200_000 + i, dtype=np.uint8) for i in range(4)]
    names = [f"h{i}" for i in range(len(data))]
    handed: list[Gather] = []
    pending_when_joined: list[int] = []
    as_bytes = xet_uploads.upload_bytes

    def spy_join(d: Any, reuse: bytearray | None = None) -> bytes | bytearray:
        out = as_bytes(d, reuse)
        pending_when_joined.append(sum(g._head is not None for g in handed))
        return out

    monkeypatch.setattr(xet_uploads, "upload_bytes", spy_join)
    with HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/h-{uuid.uuid4().hex[:6]}", token=hub.write_token,
        endpoint=hub.endpoint, token_env="", retry_backoff_secs=0.01,
    )) as raw:
        put = raw.put_many
        monkeypatch.setattr(raw, "put_many", lambda items: handed.extend(g for _, g in items) or put(items))
        store = seal_store(raw, tier="test")
        assert all(r.ok for r in store.put_many(list(zip(names, data, strict=True))))
        assert pending_when_joined == [3, 2, 1, 0]
        for g, name, d in zip(handed, names, data, strict=True):
            ident = store.identity
            eager = env.pack_header(d.nbytes, xxhash.xxh3_64_intdigest(d.tobytes()), name, ident)
            assert bytes(g.parts[0]) == eager
        outs = [np.zeros_like(d) for d in data]
        assert all(r.found for r in store.get_many(names, outs))
        assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_a_headed_gather_makes_its_head_once_and_checks_its_size() -> None:
    calls: list[int] = []

    def make(parts: tuple[memoryview, ...]) -> bytes:
        calls.append(len(parts))
        return b"H" * 4

    g = Gather.headed(4, make, b"ab", b"cd")
    assert g.nbytes == 8 and calls == []
    assert g.join() == b"HHHHabcd" and [bytes(p) for p in g.parts] == [b"HHHH", b"ab", b"cd"]
    assert calls == [2]
    assert [bytes(v) for v in g.views_from(5)] == [b"b", b"cd"]
    with pytest.raises(ValueError, match="3 bytes, 4 were announced"):
        _ = Gather.headed(4, lambda parts: b"xyz", b"a").parts
