"""kvbucket's LMCache-format names are LMCache 0.5.6's own, checked against LMCache's functions."""

from __future__ import annotations

from urllib.parse import unquote

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey as LMKey
from lmcache.v1.distributed.l2_adapters import fs_l2_adapter, hfbucket_l2_adapter, s3_l2_adapter
from lmcache.v1.storage_backend.connector.hfbucket_connector import (
    HFBucketLocation,
    encode_hfbucket_object_name,
)

from kvbucket.integrations.lmcache import to_kvbucket_key
from kvbucket.l2.naming import Naming

pytestmark = pytest.mark.lmcache

MP_KEYS = [
    LMKey(chunk_hash=(1).to_bytes(4, "big"), model_name="test/model", kv_rank=0, object_group_id=0),
    LMKey(chunk_hash=b"\x00\xff" * 8, model_name="Qwen/Qwen3-8B", kv_rank=0x01000100, object_group_id=3),
    LMKey(
        chunk_hash=b"\x12" * 16, model_name="m.v1", kv_rank=0x02010200, object_group_id=0, cache_salt="alice"
    ),
    LMKey(
        chunk_hash=b"\x12" * 16,
        model_name="a b%c",
        kv_rank=0xFFFFFFFF,
        object_group_id=0x1F,
        cache_salt="t-1",
    ),
]
CE_KEYS = [
    CacheEngineKey("test/model", 1, 0, 0x1E, torch.bfloat16),
    CacheEngineKey("org/m.v1", 8, 7, -0x1234, torch.float16),
]


@pytest.mark.parametrize("key", MP_KEYS, ids=str)
def test_mp_names_are_lmcaches(key: LMKey) -> None:
    ours = to_kvbucket_key(key)
    hf = Naming("kv", style="hfbucket", object_format="lmcache")
    assert hf.write_name(ours) == hfbucket_l2_adapter._object_key_to_bucket_path(
        key, HFBucketLocation("o/b", "kv")
    )
    s3 = Naming(style="s3", object_format="lmcache")
    # LMCache sends PUT "/" + url_quote(name); the server stores the unquoted path
    assert s3.write_name(ours) == unquote(
        s3_l2_adapter._format_safe_path(s3_l2_adapter._object_key_to_string(key))[1:]
    )
    fs = Naming(style="fs", object_format="lmcache")
    assert fs.write_name(ours) == fs_l2_adapter._object_key_to_filename(key)
    for naming in (hf, s3, fs):  # listings read them back, and the default format reads them too
        assert naming.parse(naming.write_name(ours)) == ours
        default = Naming(naming.prefix, style=naming.style)
        assert default.read_names(ours)[1] == naming.write_name(ours)
        assert default.write_name(ours) != naming.write_name(ours)
        assert not default.is_lmcache_name(default.write_name(ours))


def test_the_issues_example_names() -> None:
    key = to_kvbucket_key(LMKey(chunk_hash=(1).to_bytes(4, "big"), model_name="test/model", kv_rank=0,
                                object_group_id=0))  # fmt: skip
    hf = Naming("prefix", style="hfbucket")
    assert hf.read_names(key) == (
        "prefix/test%2Fmodel@0@00000001",
        "prefix/test%2Fmodel%4000000000%400%4000000001",
    )
    conn = Naming(style="hfbucket", connector=True)
    assert conn.read_names(CE_KEYS[0]) == (
        "test%2Fmodel@1@0@1e@bfloat16",
        "test%2Fmodel%401%400%401e%40bfloat16",
    )


@pytest.mark.parametrize("key", CE_KEYS, ids=str)
def test_connector_names_are_lmcaches(key: CacheEngineKey) -> None:
    hf = Naming(style="hfbucket", object_format="lmcache", connector=True)
    assert hf.write_name(key) == encode_hfbucket_object_name(key.to_string())
    s3 = Naming(style="s3", object_format="lmcache", connector=True)
    assert s3.write_name(key) == key.to_string().replace("/", "_")
    assert hf.parse_key_string(hf.write_name(key)) == key.to_string()


def test_foreign_and_non_canonical_names_are_not_lmcaches() -> None:
    s3 = Naming(style="s3")
    for name in ("notes.txt", "m@1@0@zz", "m@00000000@0@0A", "m@0@0@01", "x/y/m@00000000@00@01"):
        assert s3.parse(name) is None, name
    with pytest.raises(ValueError, match='"lmcache" is not available'):
        Naming(style="memory", object_format="lmcache")
