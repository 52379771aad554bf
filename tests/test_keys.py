from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbucket.errors import InvalidKeyError
from kvbucket.keys import (
    CacheEngineKey,
    ObjectKey,
    decode_key,
    encode_key,
    key_to_name,
    name_to_key,
    pack_kv_rank,
)
from kvbucket.stores.base import check_name


def test_cache_engine_key_string_form_matches_lmcache():
    k = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 0x41257AF1DD85C366, "bfloat16")
    assert k.to_string() == "meta-llama/Llama-3.1-8B@2@1@41257af1dd85c366@bfloat16"
    neg = k.with_hash(-0x41257AF1DD85C366)
    assert neg.to_string() == "meta-llama/Llama-3.1-8B@2@1@-41257af1dd85c366@bfloat16"
    assert CacheEngineKey.from_string(neg.to_string()) == neg


def test_cache_engine_key_request_configs_round_trip():
    k = CacheEngineKey("m", 1, 0, 5, "half", {"tag": "a", "lora": "x1"})
    s = k.to_string()
    assert s == "m@1@0@5@half@tag%a@lora%x1"
    back = CacheEngineKey.from_string(s)
    assert back.request_configs == {"tag": "a", "lora": "x1"}


@pytest.mark.parametrize("bad", ["m@1@0@zz@half", "m@1@0", "m@x@0@5@half", "m@1@0@5@half@noval"])
def test_cache_engine_key_parse_errors(bad):
    with pytest.raises(InvalidKeyError):
        CacheEngineKey.from_string(bad)


def test_object_key_wire_name():
    k = ObjectKey("llama", pack_kv_rank(4, 1, 2, 1), bytes.fromhex("00ff10"), "tenant-a")
    assert k.to_string() == "llama@4010201@00ff10@tenant-a"
    assert ObjectKey.from_string(k.to_string()) == k
    assert ObjectKey("m", 0, b"\x01").to_string() == "m@0@01"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_name": "a@b"}, "'@'"),
        ({"cache_salt": "a/b"}, "must not contain"),
        ({"cache_salt": "a@b"}, "must not contain"),
        ({"cache_salt": "a\\b"}, "must not contain"),
        ({"cache_salt": "a\x00b"}, "must not contain"),
        ({"cache_salt": "x" * 129}, "129 characters"),
    ],
)
def test_object_key_rejects_bad_fields(kwargs, match):
    args = {"model_name": "m", "kv_rank": 0, "chunk_hash": b"\x01", "cache_salt": ""} | kwargs
    with pytest.raises(InvalidKeyError, match=match):
        ObjectKey(**args)


def test_salt_of_128_chars_is_fine():
    assert ObjectKey("m", 0, b"\x01", "s" * 128).cache_salt == "s" * 128


def test_encoding_escapes_separators_and_dots():
    enc = encode_key("../../etc/passwd")
    assert "/" not in enc and "." not in enc
    assert decode_key(enc) == "../../etc/passwd"
    assert encode_key("a@b") == "a@b"
    assert encode_key("%") == "%25"


@pytest.mark.parametrize("bad", ["%zz", "a%2", "%41", "a/b", "", "a.b"])
def test_decode_rejects_foreign_names(bad):
    with pytest.raises(InvalidKeyError):
        decode_key(bad)


@given(st.text(min_size=1, max_size=300))
def test_encode_round_trips_any_text(s):
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates are not valid key strings
    enc = encode_key(s)
    assert decode_key(enc) == s
    assert enc not in (".", "..") and "/" not in enc
    if len(enc) <= 1024:
        check_name(enc)
    else:  # too long to be an object name: refused up front, never truncated
        with pytest.raises(InvalidKeyError, match="longer than"):
            key_to_name(s)


@given(
    st.lists(st.text(alphabet="abc/._-", min_size=1, max_size=8), max_size=3).map("/".join),
    st.text(min_size=1, max_size=80),
)
def test_no_key_escapes_its_prefix(prefix, key):
    try:
        key.encode("utf-8")
        name = key_to_name(key, prefix)
    except (InvalidKeyError, UnicodeEncodeError):
        return  # an invalid prefix is refused up front
    p = prefix.strip("/")
    if p:
        assert name.startswith(p + "/")
        rest = name[len(p) + 1 :]
    else:
        rest = name
    assert "/" not in rest and rest not in (".", "..")
    assert name_to_key(name, prefix) == key


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "..", "a/.", "a\\b", "a\x00b", "x" * 1025])
def test_check_name_rejects(bad):
    with pytest.raises(InvalidKeyError):
        check_name(bad)
