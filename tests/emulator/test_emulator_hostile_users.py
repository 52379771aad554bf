"""The emulator holds against its own users (issue 24, items 7, 8, 9 and 13).

Each test is an attack, or a failure, that a token holder (or anyone, on public buckets) could
cause, driven by the unmodified clients or by raw HTTP where the attack needs it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx2

from kvbucket.testing.hub_fixtures import MEMBER_USER, ORG, OTHER_USER, HubBucket, RunningHub


def _new_bucket(hub: RunningHub, ns: str, token: str, *, private: bool = True) -> str:
    bucket_id = f"{ns}/h-{uuid.uuid4().hex[:12]}"
    hub.api(token).create_bucket(bucket_id, private=private)
    return bucket_id


def _add_by_hash(hub: RunningHub, token: str, bucket_id: str, path: str, xet_hash: str) -> tuple[int, Any]:
    """A raw ``addFile`` line naming a hash, as any client may send it."""
    line = json.dumps({"type": "addFile", "path": path, "xetHash": xet_hash, "mtime": 1})
    r = httpx2.post(
        f"{hub.endpoint}/api/buckets/{bucket_id}/batch", content=line.encode() + b"\n",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
    )  # fmt: skip
    return r.status_code, r.json()


def _resolve(hub: RunningHub, token: str, bucket_id: str, path: str) -> tuple[int, bytes]:
    url = f"{hub.endpoint}/buckets/{bucket_id}/resolve/{path}"
    r = httpx2.get(url, headers={"Authorization": f"Bearer {token}"})
    return r.status_code, r.content


def _hash_of(hub: RunningHub, token: str, bucket_id: str, path: str) -> str:
    (info,) = hub.api(token).get_bucket_paths_info(bucket_id, [path])
    return str(info.xet_hash)


# -- item 7: an addFile by hash is for content the caller uploaded or can already read ---------------
def test_add_by_hash_of_another_users_private_file_is_refused(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    secret = b"alice's private notes " * 1000
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(secret, "notes.txt")])
    alice_hash = _hash_of(hub, hub.write_token, hub_bucket.bucket_id, "notes.txt")
    bob = hub.token(OTHER_USER)
    bobs = _new_bucket(hub, OTHER_USER, bob)

    status, body = _add_by_hash(hub, bob, bobs, "stolen.txt", alice_hash)
    assert status == 422  # every line failed
    assert body["failed"] == [{"path": "stolen.txt", "error": body["failed"][0]["error"]}]
    assert "unknown xetHash" in body["failed"][0]["error"]  # the same answer as for a hash nobody stored
    assert _resolve(hub, bob, bobs, "stolen.txt")[0] == 404
    assert list(hub.api(bob).list_bucket_tree(bobs)) == []
    # copyFile from her bucket is refused too (it was already)
    copy = json.dumps({"type": "copyFile", "path": "c.txt", "xetHash": alice_hash, "mtime": 1,
                       "sourceRepoType": "bucket", "sourceRepoId": hub_bucket.bucket_id})  # fmt: skip
    r = httpx2.post(f"{hub.endpoint}/api/buckets/{bobs}/batch", content=copy.encode(),
                    headers={"Authorization": f"Bearer {bob}"})  # fmt: skip
    assert r.status_code == 422
    # alice still reads her file
    assert _resolve(hub, hub.write_token, hub_bucket.bucket_id, "notes.txt") == (200, secret)


def test_add_by_hash_works_for_what_the_caller_uploaded_or_can_read(hub_bucket: HubBucket) -> None:
    hub = hub_bucket.hub
    data = b"the same bytes, uploaded by two users " * 500
    hub_bucket.api.batch_bucket_files(hub_bucket.bucket_id, add=[(data, "a.txt")])
    h = _hash_of(hub, hub.write_token, hub_bucket.bucket_id, "a.txt")
    bob = hub.token(OTHER_USER)
    bobs = _new_bucket(hub, OTHER_USER, bob)
    # bob uploads the same bytes himself (hf_xet dedups its chunks against what it uploaded for
    # alice, but the shard it sends names the file): his upload, his to add, again by hash
    hub.api(bob).batch_bucket_files(bobs, add=[(data, "mine.txt")])
    assert _hash_of(hub, bob, bobs, "mine.txt") == h
    assert _add_by_hash(hub, bob, bobs, "again.txt", h)[0] == 200
    assert _resolve(hub, bob, bobs, "again.txt") == (200, data)

    # content one can read: a private bucket of one's organisation, and any public bucket
    member = hub.token(MEMBER_USER)
    org_bucket = _new_bucket(hub, ORG, hub.write_token)
    shared = b"shared inside the organisation " * 300
    hub.api().batch_bucket_files(org_bucket, add=[(shared, "s.txt")])
    mine = _new_bucket(hub, MEMBER_USER, member)
    assert _add_by_hash(hub, member, mine, "s.txt", _hash_of(hub, member, org_bucket, "s.txt"))[0] == 200
    assert _resolve(hub, member, mine, "s.txt") == (200, shared)
    public = _new_bucket(hub, hub.namespace, hub.write_token, private=False)
    open_data = b"public bytes " * 300
    hub.api().batch_bucket_files(public, add=[(open_data, "p.txt")])
    assert _add_by_hash(hub, bob, bobs, "p.txt", _hash_of(hub, bob, public, "p.txt"))[0] == 200
    assert _resolve(hub, bob, bobs, "p.txt") == (200, open_data)
