"""kvbucket as a secondary tier of vLLM's multi-tier KV offloading, through vLLM 0.33.0's own classes.

vLLM pins another torch than this venv, so it runs in its own venv made by
``engines/venv.sh vllm`` (cached between runs, see docs/vllm.md). This test owns the servers (Hub
emulator, SeaweedFS) and runs tests/engines/vllm_checks.py (the tier under vLLM's tiering manager)
and vllm_connector_checks.py (vLLM's OffloadingConnector, the model identity) inside that venv
against a directory, a Hub bucket and an S3 bucket; the checks build vLLM's TieringOffloadingSpec,
which loads the tier by module path, and move chunks between the CPU tiers of two engines through
the store.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvbucket.errors import ConfigError
from kvbucket.integrations import vllm as integ
from kvbucket.testing.engines import (
    assert_all_passed,
    check_compiled_decoder,
    engine_venv,
    run_checks,
    store_targets,
)

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("vllm_checks.py")
CONNECTOR_CHECKS = Path(__file__).with_name("vllm_connector_checks.py")
N_CHECKS = 16  # test functions in the two modules run on each store
#: ... and those run once over every store (the redeploy: one fresh process per step for all three)
SHARED = ("test_one_layer_changed_in_place_misses_then_its_bytes_back_hit",)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv (built once per set of pins; about a minute the first time, then reused)."""
    return engine_venv(ROOT, "vllm")


@pytest.mark.slow(60)
def test_vllm_secondary_tier_on_dir_hub_and_s3(vllm_venv: Path, hub_bucket: Any, seaweedfs: Any,
                                               s3_bucket: str, tmp_path: Path) -> None:
    targets = store_targets(tmp_path, hub_bucket, seaweedfs, s3_bucket)
    proc = run_checks(vllm_venv, ROOT, CHECKS, "KVB_VLLM_TARGETS", targets, tmp_path, "-rA",
                      str(CONNECTOR_CHECKS))
    assert_all_passed(proc, N_CHECKS, targets, SHARED)
    assert any((tmp_path / "store").rglob("*-g0")), "the directory store holds no chunk"



def test_the_compiled_xet_decoder_runs_in_the_vllm_venv(vllm_venv: Path) -> None:
    """kvbucket's dependencies come from its metadata (engines/venv.sh): numba and llvmlite are
    there and the compiled decoder loads and decodes, as in a user's `pip install kvbucket`."""
    assert check_compiled_decoder(vllm_venv, ROOT).startswith("numba ")

# ---- main venv (no vLLM): what loads without the engine


def test_module_imports_without_vllm_and_says_how_to_get_it() -> None:
    if integ.HAVE_VLLM:  # pragma: no cover - the main venv has no vllm
        pytest.fail("the main test venv is expected not to have vllm")
    with pytest.raises(ConfigError, match="pip install vllm"):
        integ.KVBucketSecondaryTier(None, memoryview(b""), "KVBucketSecondaryTier", store_url="/x")


def test_settings_from_the_tier_config() -> None:
    s = integ.VLLMTierSettings.from_tier_config({
        "store_url": "s3://b/p", "store_options": {"s3_region": "eu-west-1"}, "cache_salt": "t1",
        "lookup": "index", "locality": "REMOTE",
    })
    assert (s.store_url, s.store_options, s.cache_salt, s.prefix, s.lookup) == (
        "s3://b/p", {"s3_region": "eu-west-1"}, "t1", "vllm", "index")
    with pytest.raises(ConfigError, match="store_url"):
        integ.VLLMTierSettings.from_tier_config({"prefix": "x"})
    with pytest.raises(ConfigError, match="cache_sault"):
        integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "cache_sault": "typo"})
    with pytest.raises(ConfigError, match="lookup"):
        integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "lookup": "sometimes"})


def test_metrics_keys_as_the_lmcache_adapters_take_them() -> None:
    """``metrics_port`` / ``metrics_addr`` are the L2 adapter's keys, checked the same way."""
    s = integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "metrics_port": 9464,
                                                 "metrics_addr": "0.0.0.0"})
    assert (s.metrics_port, s.metrics_addr) == (9464, "0.0.0.0")
    assert integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "metrics_port": 9464}).metrics_addr \
        == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"metrics_port.*from 1 to 65535"):
        integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "metrics_port": 0})
    with pytest.raises(ConfigError, match="metrics_addr is set but metrics_port is not"):
        integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "metrics_addr": "0.0.0.0"})
    with pytest.raises(ConfigError, match=r"metrics_addr.*no scheme, no port"):
        integ.VLLMTierSettings.from_tier_config({"store_url": "/x", "metrics_port": 9464,
                                                 "metrics_addr": "http://0.0.0.0:9464"})


def test_known_chunks_are_bounded_and_misses_expire() -> None:
    k = integ._KnownChunks(limit=2, miss_ttl=0.05)
    k.add([b"a", b"b", b"c"])
    assert k.state([b"a", b"b", b"c"]) == [None, True, True]  # the oldest dropped
    k.miss([b"x"])
    assert k.state([b"x"]) == [False]
    k.discard([b"b"])
    assert k.state([b"b"]) == [None]
    time.sleep(0.1)
    assert k.state([b"x"]) == [None]  # a remembered miss expires: the store is asked again


def test_main_venv_is_not_the_vllm_venv() -> None:
    assert "vllm" not in sys.modules
