"""S3Store over real servers: SeaweedFS (checks signatures) and moto (quick logic)."""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbucket.errors import InvalidKeyError, SizeMismatchError, StoreError
from kvbucket.keys import CacheEngineKey, key_to_name, name_to_key
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.s3_server import S3Server

MiB = 1024 * 1024


@pytest.fixture(params=["seaweedfs", "moto"])
def server_and_bucket(request: pytest.FixtureRequest) -> tuple[S3Server, str]:
    server = request.getfixturevalue("seaweedfs" if request.param == "seaweedfs" else "moto_s3")
    bucket = request.getfixturevalue("s3_bucket" if request.param == "seaweedfs" else "moto_bucket")
    return server, bucket


@pytest.fixture
def store(server_and_bucket: tuple[S3Server, str]) -> Iterator[S3Store]:
    server, bucket = server_and_bucket
    with S3Store.from_config(S3Config.parse(server.config(bucket, "kv/cache"))) as s:
        yield s


def test_round_trip_missing_and_sizes(store: S3Store) -> None:
    payload = os.urandom(3000)
    results = store.put_many([("a", payload), ("b", bytearray(b"x")), ("c", np.arange(10, dtype=np.int32))])
    assert [(r.ok, r.size) for r in results] == [(True, 3000), (True, 1), (True, 40)]
    got = store.get_many(["a", "missing", "c"])
    assert bytes(got[0].data) == payload and got[0].size == 3000
    assert got[1].ok and got[1].size is None and got[1].data is None
    assert np.array_equal(np.frombuffer(bytes(got[2].data), dtype=np.int32), np.arange(10, dtype=np.int32))
    assert [r.size for r in store.head_many(["a", "b", "zzz"])] == [3000, 1, None]
    assert store.put("empty", b"") == 0 and store.get("empty") == b""


def test_read_into_buffers_checks_length_first(store: S3Store) -> None:
    data = os.urandom(4096)
    store.put("chunk", data)
    buf = bytearray(4096)
    assert store.get_into("chunk", buf) and buf == data
    for wrong in (bytearray(b"\xee" * 5000), bytearray(b"\xee" * 100)):  # long buffer = short object
        (r,) = store.get_many(["chunk"], [wrong])
        assert isinstance(r.error, SizeMismatchError) and r.size is None
        assert set(wrong) == {0xEE}, "a refused buffer must not be written"
    arr = np.zeros(1024, dtype=np.float32)
    assert store.get_into("chunk", arr) and arr.tobytes() == data
    assert not store.get_into("absent", bytearray(10))


def test_batch_results_are_per_item_and_in_order(store: S3Store) -> None:
    items = [(f"k{i:03d}", os.urandom(100 + i)) for i in range(60)]
    assert all(r.ok for r in store.put_many(items))
    names = [n for n, _ in items] + ["nope"]
    bufs = [bytearray(len(d)) for _, d in items] + [bytearray(3)]
    bufs[5] = bytearray(1)  # one wrong buffer fails only its own item
    results = store.get_many(names, bufs)
    assert [r.name for r in results] == names
    assert isinstance(results[5].error, SizeMismatchError)
    assert all(r.ok and bytes(bufs[i]) == items[i][1] for i, r in enumerate(results[:-1]) if i != 5)
    assert results[-1].ok and results[-1].size is None
    with pytest.raises(ValueError, match="buffers"):
        store.get_many(["a", "b"], [bytearray(1)])


def test_encoded_key_names_round_trip_and_match_other_clients(
    store: S3Store, server_and_bucket: tuple[S3Server, str]
) -> None:
    server, bucket = server_and_bucket
    key = CacheEngineKey("meta-llama/Llama-3.1-8B", 1, 0, -0xAB, "bf16", {"lora": "x y"})
    name = key_to_name(key, "layers")
    assert "%2F" in name and "@" in name
    odd = [
        "m%2Fx@1@0@ab@bf16",
        "a~b",
        "sp ace+plus",
        "%25lit",
        "ünï/cødé",
        "a#b",
        "q?x",
        "st*r",
        "br{a}ce",
        "<lt>|pipe",
        "eq=x&y",
        "caret^`",
        "semi;col:on",
        "[br]",
        "emoji😀",
    ]
    store.put_many([(name, b"1")] + [(n, b"2") for n in odd])
    listed = sorted(o.name for o in store.list())
    assert listed == sorted([name, *odd])
    assert name_to_key(name, "layers") == key.to_string()
    boto_keys = sorted(o["Key"] for o in server.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert boto_keys == sorted(f"kv/cache/{n}" for n in [name, *odd])
    body = server.client().get_object(Bucket=bucket, Key="kv/cache/m%2Fx@1@0@ab@bf16")["Body"].read()
    assert body == b"2"


def test_list_is_a_plain_string_prefix(store: S3Store) -> None:
    names = ["a/b", "a/bc", "a/c/d", "ab", "b", "a%2Fx@1", "a%2Fy@2"]
    store.put_many([(n, n.encode()) for n in names])

    def ls(prefix: str = "") -> list[str]:
        return sorted(o.name for o in store.list(prefix))

    assert ls() == sorted(names)
    assert ls("a/b") == ["a/b", "a/bc"]
    assert ls("a/") == ["a/b", "a/bc", "a/c/d"]
    assert ls("a%2F") == ["a%2Fx@1", "a%2Fy@2"]
    assert ls("a") == sorted(n for n in names if n.startswith("a"))
    assert ls("zz") == []
    assert {o.name: o.size for o in store.list("a/c")} == {"a/c/d": 5}
    assert all(o.mtime and o.mtime > 1.6e9 for o in store.list())
    assert len(list(store.list(page_size=2))) == len(names)


def test_delete_and_prefix_isolation(server_and_bucket: tuple[S3Server, str], store: S3Store) -> None:
    server, bucket = server_and_bucket
    with S3Store(S3Config.parse(server.config(bucket, "kv/other"))) as other:
        other.put("a", b"other")
        store.put_many([("a", b"mine"), ("b", b"mine")])
        assert [r.ok for r in store.delete_many(["a", "never-there"])] == [True, True]
        assert store.get("a") is None and store.get("b") == b"mine"
        assert other.get("a") == b"other"
        assert [o.name for o in other.list()] == ["a"]


@pytest.mark.parametrize("name", ["../escape", "/abs", "a//b", "a/./b", "", "back\\slash"])
def test_names_cannot_escape_the_prefix(store: S3Store, name: str) -> None:
    with pytest.raises(InvalidKeyError):
        store.put_many([(name, b"x")])


def test_multipart_objects(seaweedfs: S3Server, s3_bucket: str) -> None:
    cfg = seaweedfs.config(s3_bucket, s3_multipart_threshold=6 * MiB, s3_multipart_part_size=5 * MiB)
    data = os.urandom(13 * MiB)
    with S3Store(S3Config.parse(cfg)) as store:
        assert store.put("big", data) == len(data)
        etag = seaweedfs.client().head_object(Bucket=s3_bucket, Key="big")["ETag"]
        assert etag.strip('"').endswith("-3"), f"expected a 3-part multipart upload, ETag {etag}"
        buf = bytearray(len(data))
        assert store.get_into("big", buf) and buf == data
        store.put("small", b"s" * MiB)
        head = seaweedfs.client().head_object(Bucket=s3_bucket, Key="small")
        assert "-" not in head["ETag"] and head["ContentType"] == "application/octet-stream"


def test_closed_store_refuses_work(seaweedfs: S3Server, s3_bucket: str) -> None:
    store = S3Store(S3Config.parse(seaweedfs.config(s3_bucket)))
    store.close()
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.head("x")


def test_a_child_forked_after_s3_calls_gets_a_clear_error_not_a_hang(
    seaweedfs: S3Server, s3_bucket: str
) -> None:
    """obstore's tokio threads do not survive fork(): without the check the child hangs forever."""
    store = S3Store(S3Config.parse(seaweedfs.config(s3_bucket, "fork")))
    store.put("k", b"before fork")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each verb did, then leave without cleanup
        os.close(r)
        out = []
        for call in (lambda: store.get_many(["k"]), lambda: store.put_many([("x", b"1")]),
                     lambda: S3Store(store.config).head_many(["k"])):  # fmt: skip
            try:
                call()
                out.append("no error")
            except StoreError as e:
                out.append(("spawn" in str(e) and "forked" in str(e) and "refused") or str(e))
        os.write(w, "|".join(out).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    report = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 1.0)
        if ready:
            report = os.read(r, 4096)
            break
    os.close(r)
    if not report:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert report.decode() == "refused|refused|refused"
    # The parent's store is unaffected by the child.
    assert store.get("k") == b"before fork"
    store.close()
