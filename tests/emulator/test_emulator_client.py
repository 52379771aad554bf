"""The unmodified huggingface_hub + hf_xet clients against the emulator: the core bucket flows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from huggingface_hub.errors import BucketBatchError, BucketNotFoundError, HfHubHTTPError

from kvbucket.testing.hub_emulator.xet import chunk_hash, file_hash, hash_to_hex
from kvbucket.testing.hub_fixtures import HubBucket, RunningHub

SIZES = [0, 1, 65_535, 65_537, 2 * 1024 * 1024]


def _blob(n: int, seed: int = 0) -> bytes:
    # half random, half repetitive: exercises LZ4 and byte-grouped chunks as well as raw ones
    head = os.urandom(n // 2)
    tail = bytes((i * 7 + seed) % 251 for i in range(min(n - n // 2, 4096))) * ((n - n // 2) // 4096 + 1)
    return (head + tail)[:n]


def test_create_exist_ok_info_list_settings_delete(hub_emulator: RunningHub) -> None:
    api = hub_emulator.api()
    bid = f"{hub_emulator.namespace}/lifecycle"
    url = api.create_bucket(bid, private=True)
    assert url.bucket_id == bid
    with pytest.raises(HfHubHTTPError) as e:
        api.create_bucket(bid)
    assert e.value.response.status_code == 409
    assert api.create_bucket(bid, exist_ok=True).bucket_id == bid
    info = api.bucket_info(bid)
    assert (info.id, info.private, info.size, info.total_files) == (bid, True, 0, 0)
    assert bid in [b.id for b in api.list_buckets(hub_emulator.namespace)]
    assert bid in [b.id for b in api.list_buckets()]  # "me" = the token's user
    api.update_bucket_settings(bid, private=False)
    assert api.bucket_info(bid).private is False
    assert api.bucket_info(bid, token=False).id == bid  # public now: anonymous can see it
    api.delete_bucket(bid)
    with pytest.raises(BucketNotFoundError):
        api.bucket_info(bid)
    api.delete_bucket(bid, missing_ok=True)


def test_move_bucket_keeps_its_files(hub_emulator: RunningHub) -> None:
    api = hub_emulator.api()
    src, dst = f"{hub_emulator.namespace}/move-src", f"{hub_emulator.namespace}/move-dst"
    api.create_bucket(src, private=True)
    api.batch_bucket_files(src, add=[(b"moved", "m.txt")])
    api.move_bucket(src, dst)
    with pytest.raises(BucketNotFoundError):
        api.bucket_info(src)
    assert [f.path for f in api.list_bucket_tree(dst)] == ["m.txt"]
    assert api.bucket_info(dst).private is True


def test_create_in_me_namespace(hub_emulator: RunningHub) -> None:
    url = hub_emulator.api().create_bucket("no-namespace-given", exist_ok=True)
    assert url.bucket_id == f"{hub_emulator.namespace}/no-namespace-given"


def test_bytes_round_trip_for_edge_sizes(hub_bucket: HubBucket, tmp_path: Path) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    blobs = {f"sizes/{n}.bin": _blob(n, n) for n in SIZES}
    api.batch_bucket_files(bid, add=[(data, path) for path, data in blobs.items()])
    infos = {f.path: f for f in api.get_bucket_paths_info(bid, list(blobs))}
    assert {p: f.size for p, f in infos.items()} == {p: len(d) for p, d in blobs.items()}
    api.download_bucket_files(bid, [(p, tmp_path / p) for p in blobs])
    for p, data in blobs.items():
        assert (tmp_path / p).read_bytes() == data, p
    assert api.bucket_info(bid).total_files == len(SIZES)
    assert api.bucket_info(bid).size == sum(SIZES)


def test_xet_hash_matches_the_xet_definition(hub_bucket: HubBucket) -> None:
    """A file below the minimum chunk size is one chunk: its file hash is computable by hand."""
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    api.batch_bucket_files(bid, add=[(b"hello xet", "h.txt")])
    (info,) = api.get_bucket_paths_info(bid, ["h.txt"])
    assert info.xet_hash == hash_to_hex(file_hash([(chunk_hash(b"hello xet"), 9)]))


def test_add_from_files_copy_and_delete(hub_bucket: HubBucket, tmp_path: Path) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    src = tmp_path / "local.bin"
    src.write_bytes(_blob(300_000))
    api.batch_bucket_files(bid, add=[(str(src), "a/local.bin")])
    (info,) = api.get_bucket_paths_info(bid, ["a/local.bin"])
    api.batch_bucket_files(bid, copy=[("bucket", bid, info.xet_hash, "b/copy.bin")])
    api.download_bucket_files(bid, [("b/copy.bin", tmp_path / "copy.bin")])
    assert (tmp_path / "copy.bin").read_bytes() == src.read_bytes()
    api.batch_bucket_files(bid, delete=["a/local.bin"])
    assert [f.path for f in api.list_bucket_tree(bid, recursive=True)] == ["b/copy.bin"]


def test_tree_prefix_recursive_and_directories(hub_bucket: HubBucket) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    paths = ["top.txt", "d/x.txt", "d/e/y.txt", "d/e/z.txt", "dd/w.txt", "d-other.txt"]
    api.batch_bucket_files(bid, add=[(p.encode(), p) for p in paths])
    root = {(e.type, e.path) for e in api.list_bucket_tree(bid, recursive=False)}
    assert root == {("file", "top.txt"), ("directory", "d"), ("directory", "dd"), ("file", "d-other.txt")}
    assert sorted(e.path for e in api.list_bucket_tree(bid, recursive=True)) == sorted(paths)
    under_d = {(e.type, e.path) for e in api.list_bucket_tree(bid, prefix="d", recursive=False)}
    # the Hub matches the prefix lexically: "dd/" and "d-other.txt" come too (HfFileSystem filters)
    assert {("file", "d/x.txt"), ("directory", "d/e")} <= under_d
    assert sorted(e.path for e in api.list_bucket_tree(bid, prefix="d/e", recursive=True)) == [
        "d/e/y.txt",
        "d/e/z.txt",
    ]
    assert {e.path for e in api.list_bucket_tree(bid, prefix="d/", recursive=False)} == {"d/x.txt", "d/e"}


def test_tree_pagination_over_2500_files_and_paths_info_1000_plus(hub_bucket: HubBucket) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    api.batch_bucket_files(bid, add=[(b"payload", "seed")])
    (seed,) = api.get_bucket_paths_info(bid, ["seed"])
    names = [f"many/{i:05d}" for i in range(2500)]
    # server-side copies: 2,500 entries without 2,500 uploads
    api.batch_bucket_files(bid, copy=[("bucket", bid, seed.xet_hash, n) for n in names])
    listed = [e.path for e in api.list_bucket_tree(bid, prefix="many", recursive=True)]
    assert listed == names
    assert hub_bucket.hub.stats()["routes"]["tree"]["requests"] >= 3  # 1,000 a page
    non_rec = list(api.list_bucket_tree(bid, prefix="many"))
    assert len(non_rec) == 2500 and all(e.type == "file" for e in non_rec)
    wanted = [*names[::2], "many/missing"]  # 1,251 paths -> two requests of the client
    got = list(api.get_bucket_paths_info(bid, wanted))
    assert [f.path for f in got] == names[::2]
    assert all(f.size == len(b"payload") and f.xet_hash == seed.xet_hash for f in got)


def test_percent_encoded_object_names_end_to_end(hub_bucket: HubBucket, tmp_path: Path) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    names = ["m%2Fx@1@0@ab@bf16", "pre/fix/m%2Fx@1@0@cd@bf16", "100%25 sure", "sp ace+plus&amp?q#h"]
    blobs = {n: _blob(1000 + i, i) for i, n in enumerate(names)}
    api.batch_bucket_files(bid, add=[(d, n) for n, d in blobs.items()])
    assert sorted(e.path for e in api.list_bucket_tree(bid, recursive=True)) == sorted(names)
    assert [e.path for e in api.list_bucket_tree(bid, prefix="pre/fix", recursive=True)] == [names[1]]
    for n, d in blobs.items():
        meta = api.get_bucket_file_metadata(bid, n)
        assert meta.size == len(d)
    api.download_bucket_files(bid, [(n, tmp_path / f"f{i}") for i, n in enumerate(names)])
    for i, n in enumerate(names):
        assert (tmp_path / f"f{i}").read_bytes() == blobs[n]
    api.batch_bucket_files(bid, delete=[names[0]])
    assert names[0] not in {e.path for e in api.list_bucket_tree(bid, recursive=True)}


def test_metadata_of_missing_file_is_entry_not_found(hub_bucket: HubBucket) -> None:
    from huggingface_hub.errors import RemoteEntryNotFoundError

    with pytest.raises(RemoteEntryNotFoundError):
        hub_bucket.api.get_bucket_file_metadata(hub_bucket.bucket_id, "nope")


def test_private_bucket_is_invisible_without_token(hub_bucket: HubBucket) -> None:
    anon = hub_bucket.hub.api(token=False)
    with pytest.raises(BucketNotFoundError):
        anon.bucket_info(hub_bucket.bucket_id)
    with pytest.raises(BucketNotFoundError):
        list(anon.list_bucket_tree(hub_bucket.bucket_id))
    with pytest.raises(BucketNotFoundError):
        list(anon.get_bucket_paths_info(hub_bucket.bucket_id, ["x"]))


def test_wrong_token_is_refused(hub_bucket: HubBucket) -> None:
    with pytest.raises(HfHubHTTPError) as e:
        hub_bucket.hub.api(token="hf_not_a_real_token").bucket_info(hub_bucket.bucket_id)
    assert e.value.response.status_code == 401


def test_read_token_reads_but_cannot_write(hub_bucket: HubBucket, tmp_path: Path) -> None:
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(b"data", "r.txt")])
    reader = hub_bucket.hub.api(token=hub_bucket.hub.read_token)
    assert [f.path for f in reader.list_bucket_tree(hub_bucket.bucket_id, recursive=True)] == ["r.txt"]
    reader.download_bucket_files(hub_bucket.bucket_id, [("r.txt", tmp_path / "r.txt")])
    assert (tmp_path / "r.txt").read_bytes() == b"data"
    # hf_xet asks for a Xet write token and gets 403; it reports that as a ConnectionError
    with pytest.raises((HfHubHTTPError, ConnectionError), match="403"):
        reader.batch_bucket_files(hub_bucket.bucket_id, add=[(b"evil", "w.txt")])
    with pytest.raises(HfHubHTTPError):
        reader.batch_bucket_files(hub_bucket.bucket_id, delete=["r.txt"])
    with pytest.raises(HfHubHTTPError):
        reader.create_bucket(f"{hub_bucket.hub.namespace}/by-reader")
    assert [f.path for f in reader.list_bucket_tree(hub_bucket.bucket_id, recursive=True)] == ["r.txt"]


def test_partial_batch_failure_is_bucket_batch_error(hub_bucket: HubBucket) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    api.batch_bucket_files(bid, add=[(b"ok", "ok.txt")])
    (ok,) = api.get_bucket_paths_info(bid, ["ok.txt"])
    bogus = "ab" * 32  # a well-formed hash the CAS has never seen
    with pytest.raises(BucketBatchError) as e:
        api.batch_bucket_files(
            bid, copy=[("bucket", bid, ok.xet_hash, "good-copy"), ("bucket", bid, bogus, "bad-copy")]
        )
    assert [f["path"] for f in e.value.failures] == ["bad-copy"]
    assert "bad-copy" in str(e.value)
    # not transactional, as on the Hub: the good line landed, the bad one did not
    assert {f.path for f in api.list_bucket_tree(bid, recursive=True)} == {"ok.txt", "good-copy"}


def test_all_lines_failing_is_reported_too(hub_bucket: HubBucket) -> None:
    with pytest.raises(BucketBatchError) as e:
        hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, copy=[("bucket", "x/y", "cd" * 32, "p")])
    assert e.value.response.status_code == 422
    assert len(e.value.failures) == 1
