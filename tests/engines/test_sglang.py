"""kvbucket as SGLang's HiCache storage, through SGLang 0.5.23's own classes.

SGLang pins another torch than this venv (torch 2.14.1, and its host KV pool imports
torchvision), so it runs in its own venv made by ``engines/venv.sh sglang`` (cached between runs,
see docs/sglang.md). This test owns the servers (Hub emulator, SeaweedFS) and runs
tests/engines/sglang_checks.py inside that venv against a directory, a Hub bucket and an S3
bucket; the checks create the backend with SGLang's StorageBackendFactory and move pages between
real SGLang host KV pools.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvbucket.errors import ConfigError
from kvbucket.integrations import sglang as integ
from kvbucket.testing.engines import (
    assert_all_passed,
    check_compiled_decoder,
    engine_venv,
    run_checks,
    store_targets,
)

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("sglang_checks.py")
N_CHECKS = 12  # test functions in sglang_checks.py run on each store
#: ... and those run once over every store (the redeploy: one fresh process per step for all three)
SHARED = ("test_one_layer_changed_in_place_misses_then_its_bytes_back_hit",)


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    """The SGLang venv (built once per set of pins; minutes the first time, then reused)."""
    return engine_venv(ROOT, "sglang")


@pytest.mark.slow(60)
def test_sglang_hicache_backend_on_dir_hub_and_s3(sglang_venv: Path, hub_bucket: Any, seaweedfs: Any,
                                                   s3_bucket: str, tmp_path: Path) -> None:
    targets = store_targets(tmp_path, hub_bucket, seaweedfs, s3_bucket)
    proc = run_checks(sglang_venv, ROOT, CHECKS, "KVB_SGLANG_TARGETS", targets, tmp_path, "-rA")
    assert_all_passed(proc, N_CHECKS, targets, SHARED)
    assert any((tmp_path / "store").rglob("*")), "the directory store holds no page"



def test_the_compiled_xet_decoder_runs_in_the_sglang_venv(sglang_venv: Path) -> None:
    """kvbucket's dependencies come from its metadata (engines/venv.sh): numba and llvmlite are
    there and the compiled decoder loads and decodes, as in a user's `pip install kvbucket`."""
    assert check_compiled_decoder(sglang_venv, ROOT).startswith("numba ")

# ---- main venv (no SGLang): what loads without the engine


def test_module_imports_without_sglang_and_says_how_to_get_it() -> None:
    if integ.HAVE_SGLANG:  # pragma: no cover - the main venv has no sglang
        pytest.fail("the main test venv is expected not to have sglang")
    with pytest.raises(ConfigError, match="pip install sglang"):
        integ.KVBucketHiCacheStorage(object())


def test_settings_from_extra_config() -> None:
    s = integ.SGLangStorageSettings.from_extra_config({
        "backend_name": "kvbucket", "module_path": "kvbucket.integrations.sglang",
        "class_name": "KVBucketHiCacheStorage", "interface_v1": 1, "store_url": "s3://b/p",
        "store_options": {"s3_region": "eu-west-1"}, "cache_salt": "t1",
    })
    assert (s.store_url, s.store_options, s.cache_salt, s.prefix) == ("s3://b/p", {"s3_region": "eu-west-1"},
                                                                     "t1", "sglang")
    with pytest.raises(ConfigError, match="store_url"):
        integ.SGLangStorageSettings.from_extra_config({"backend_name": "kvbucket"})
    with pytest.raises(ConfigError, match="cache_sault"):
        integ.SGLangStorageSettings.from_extra_config({"store_url": "/x", "cache_sault": "typo"})


def test_name_segments() -> None:
    assert integ.salt_segment("") == "nosalt"
    a, b = integ.salt_segment("tenant-a"), integ.salt_segment("tenant-b")
    assert a != b and "tenant" not in a and a.startswith("salt-")

    class Cfg:
        is_mla_model, tp_rank, tp_size, pp_rank, pp_size = False, 1, 4, 0, 1
        attn_cp_rank, attn_cp_size, dcp_rank, dcp_size, logical_page_size = 0, 1, 0, 1, None

    assert integ.shard_segment(Cfg) == "tp1of4"
    Cfg.is_mla_model = True
    assert integ.shard_segment(Cfg) == "mla"
    Cfg.pp_size, Cfg.pp_rank = 2, 1
    assert integ.shard_segment(Cfg) == "mla-pp1of2"


def test_main_venv_is_not_the_sglang_venv() -> None:
    assert "sglang" not in sys.modules
