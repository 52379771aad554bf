"""Compatibility with the real lmcache package: its keys and its config loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout
from kvbucket.config import EngineConfig
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import as_bytes, chunk_bytes
from kvbucket.testing.seed_configs import (
    SEED_001_MINIMAL,
    SEED_001_MULTI,
    SEED_004_BASIC,
    SEED_004_COREWEAVE,
)

pytestmark = pytest.mark.lmcache
lmcache_utils = pytest.importorskip("lmcache.utils")
lmcache_config = pytest.importorskip("lmcache.v1.config")
torch = pytest.importorskip("torch")

LAYOUT = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)


def test_lmcache_keys_work_as_backend_keys_and_list_round_trips(tmp_path: Path) -> None:
    keys = [
        lmcache_utils.CacheEngineKey("meta-llama/Llama-3.1-8B", 8, 3, -0x41257AF1DD85C366, torch.bfloat16),
        lmcache_utils.CacheEngineKey("Qwen/Qwen2.5-0.5B", 1, 0, 0x1234, torch.float16,
                                     {"lmcache.tag.user": "alice"}),
    ]
    stack = HybridBackend([LocalCPUBackend(1 << 20), LocalDiskBackend(tmp_path / "disk", 1 << 20),
                           RemoteBackend(FileStore(tmp_path / "remote"), LAYOUT)])
    with stack:
        for i, k in enumerate(keys):
            stack.put(k, chunk_bytes(LAYOUT, i))
        for i, k in enumerate(keys):
            assert as_bytes(stack.get(k)) == chunk_bytes(LAYOUT, i)
            assert stack.contains(k.to_string())
        for tier in stack.tiers:  # every tier's list() parses back into LMCache's own keys
            assert {lmcache_utils.CacheEngineKey.from_string(s) for s in tier.list()} == set(keys)


@pytest.mark.parametrize("yaml_text", [SEED_001_MINIMAL, SEED_001_MULTI, SEED_004_BASIC, SEED_004_COREWEAVE])
def test_seed_files_mean_the_same_to_lmcache_and_kvbucket(tmp_path: Path, yaml_text: str) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(yaml_text)
    ours = EngineConfig.from_file(path)
    theirs = lmcache_config.LMCacheEngineConfig.from_file(str(path))
    for name in EngineConfig.model_fields:
        value = getattr(theirs, name)
        if name == "extra_config":
            value = value or {}
        if name == "remote_storage_plugins":
            value = value or []
        assert getattr(ours, name) == value, name


def test_lmcache_only_keys_are_lmcache_keys_kvbucket_does_not_take() -> None:
    from kvbucket.config import LMCACHE_ONLY_KEYS

    lmcache_keys = set(lmcache_config._CONFIG_DEFINITIONS)
    assert lmcache_keys >= LMCACHE_ONLY_KEYS
    assert not LMCACHE_ONLY_KEYS & set(EngineConfig.model_fields)
    assert lmcache_keys >= set(EngineConfig.model_fields)  # every kvbucket key is an LMCache key
