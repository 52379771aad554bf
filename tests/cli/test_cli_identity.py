"""``kvbucket du`` by model and identity and ``kvbucket rm --model --identity`` (with --dry-run),
on a Hub bucket (the emulator) and on S3 (SeaweedFS), over chunks written by real L2 adapters of
two identities and one without (name only), and an engine tier's page names."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from kvbucket.cli import build_app
from kvbucket.identity.core import IdentitySetting
from kvbucket.identity.manifest import manifest_name
from kvbucket.keys import ObjectKey
from kvbucket.l2 import ObjectStoreL2Adapter
from kvbucket.l2.naming import Naming
from kvbucket.stores import open_store
from kvbucket.testing import l2 as t
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.s3_server import S3Server

MODEL = "org/llama"
CHUNK = 512
OLD, NEW = "org/llama@rev-1", "org/llama@rev-2"


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(build_app(), list(args))
    return r.exit_code, r.stdout, r.stderr


def keys(n: int, first: int) -> list[ObjectKey]:
    return [ObjectKey(MODEL, 0, (first + i).to_bytes(8, "big")) for i in range(n)]


def write_generations(url: str) -> dict[str, str]:
    """3 chunks of OLD, 2 of NEW, 1 name-only (each identity's manifest too), 2 engine pages."""
    tokens = {w: IdentitySetting(w).token(MODEL) or "" for w in (OLD, NEW)}
    for identity, ks in ((OLD, keys(3, 0)), (NEW, keys(2, 10)), (None, keys(1, 20))):
        store = open_store(url)
        adapter = ObjectStoreL2Adapter(store, full_chunk_bytes=CHUNK,
                                       naming=Naming(identity=IdentitySetting(identity)))  # fmt: skip
        try:
            assert t.store(adapter, ks, [bytes([i + 1]) * CHUNK for i in range(len(ks))]).success
            if identity is not None:  # the manifest is written in the background after a store
                name = manifest_name("", MODEL, tokens[identity])
                deadline = time.monotonic() + 30
                while store.head(name) is None:
                    assert time.monotonic() < deadline, "no manifest"
                    time.sleep(0.05)
        finally:
            adapter.close()
    with open_store(url) as raw:  # an engine tier's pages: <prefix>/<model>~<token>/<salt>/...
        raw.put_many([(f"sglang/org--llama~{tokens[OLD]}/nosalt/tp0of1/layer_first-b512/p{i}", b"p" * 100)
                      for i in range(2)])  # fmt: skip
    return tokens


def check_du_and_rm(url: str) -> None:
    tokens = write_generations(url)
    code, out, err = run("du", url, "--format", "json")
    assert code == 0, err
    listed = json.loads(out)["by_model_identity"]
    gens = {(g["model"], g["identity"]): (g["chunks"], g["bytes"]) for g in listed}
    assert gens == {(MODEL, tokens[OLD]): (3, 3 * (CHUNK + 64)), (MODEL, tokens[NEW]): (2, 2 * (CHUNK + 64)),
                    (MODEL, "none"): (1, CHUNK + 64), ("org--llama", tokens[OLD]): (2, 200)}  # fmt: skip
    assert all(g["last_write"] for g in listed)
    code, out, _ = run("du", url)
    assert code == 0 and f"  {MODEL}  {tokens[OLD]}: 3 chunks" in out and "none (name only): 1 chunk," in out
    with open_store(url) as store:
        before = sorted(i.name for i in store.list(""))
    code, out, _ = run("rm", url, "--model", MODEL, "--identity", tokens[OLD], "--dry-run")
    assert code == 0 and "(dry run) would remove 4" in out  # 3 chunks and the identity's manifest
    with open_store(url) as store:
        assert sorted(i.name for i in store.list("")) == before
    code, out, _ = run("rm", url, "--model", MODEL, "--identity", tokens[OLD])
    assert code == 0 and "removed 4" in out
    code, out, _ = run("rm", url, "--model", MODEL, "--identity", "none")
    assert code == 0 and "removed 1" in out
    code, out, _ = run("du", url, "--format", "json")
    left = {(g["model"], g["identity"]) for g in json.loads(out)["by_model_identity"]}
    assert left == {(MODEL, tokens[NEW]), ("org--llama", tokens[OLD])}
    # the other generation is untouched: its adapter still hits every chunk
    adapter = ObjectStoreL2Adapter(open_store(url), full_chunk_bytes=CHUNK,
                                   naming=Naming(identity=IdentitySetting(NEW)))  # fmt: skip
    try:
        assert adapter.wait_until_rebuilt(30)
        assert t.lookup(adapter, keys(2, 10)) == [True, True]
        adapter.submit_unlock(keys(2, 10))
    finally:
        adapter.close()
    code, _, err = run("rm", url, "--model", MODEL)
    assert code == 2 and "--model and --identity go together" in err


def test_du_and_rm_by_identity_on_a_hub_bucket(hub_bucket: HubBucket,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub_bucket.hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_bucket.hub.write_token)
    check_du_and_rm(f"hf://buckets/{hub_bucket.bucket_id}/kv")


def test_du_and_rm_by_identity_on_s3(seaweedfs: S3Server, s3_bucket: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    check_du_and_rm(f"s3://{s3_bucket}/kv")


def test_generations_from_names_alone() -> None:
    from kvbucket.identity.usage import generations, model_and_token
    from kvbucket.stores.base import ObjectInfo

    tok = "0123456789abcdef"
    assert model_and_token(f"kv/org%2Fm~{tok}@0@aa") == ("org/m", tok)
    assert model_and_token("kv/org%2Fm@0@aa") == ("org/m", None)
    assert model_and_token(f"vllm/org--m~{tok}/nosalt/anytp-1234/ab-g0") == ("org--m", tok)
    assert model_and_token(f"kv/_identity/org%2Fm/{tok}") is None
    assert model_and_token("kv/_fleet/j/node/1") is None and model_and_token("plain/a.bin") is None
    got = generations([ObjectInfo(f"org%2Fm~{tok}@0@aa", 10, 5.0),
                       ObjectInfo(f"org%2Fm~{tok}@0@bb", 20, 7.0)])
    assert [g.to_dict() for g in got] == [{"model": "org/m", "identity": tok, "chunks": 2, "bytes": 30,
                                           "last_write": 7.0, "weights": None, "fields": None,
                                           "first_write": None, "host": None,
                                           "manifest": "missing"}]  # fmt: skip
