"""kvbucket as SGLang's HiCache storage, through SGLang 0.5.23's own classes.

SGLang pins another torch than this venv (torch 2.14.1, and its host KV pool imports
torchvision), so it runs in its own venv made by ``engines/venv.sh sglang`` (cached between runs,
see docs/sglang.md). This test owns the servers (Hub emulator, SeaweedFS) and runs
tests/engines/sglang_checks.py inside that venv against a directory, a Hub bucket and an S3
bucket; the checks create the backend with SGLang's StorageBackendFactory and move pages between
real SGLang host KV pools.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbucket.errors import ConfigError
from kvbucket.integrations import sglang as integ

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("sglang_checks.py")
N_CHECKS = 8  # test functions in sglang_checks.py


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    """The SGLang venv (built once per set of pins; minutes the first time, then reused)."""
    proc = subprocess.run(["bash", str(ROOT / "engines" / "venv.sh"), "sglang"], capture_output=True,
                          text=True, timeout=3000)
    assert proc.returncode == 0, f"engines/venv.sh sglang failed:\n{proc.stderr[-4000:]}"
    venv = Path(proc.stdout.strip().splitlines()[-1])
    assert (venv / ".complete").exists()
    return venv


def run_checks(venv: Path, targets: dict[str, Any], tmp_path: Path, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "PYTEST_"))}
    env.update({
        "PYTHONPATH": str(ROOT / "src"),
        "KVB_SGLANG_TARGETS": json.dumps(targets),
        "HF_XET_CACHE": str(tmp_path / "xet"),  # hf_xet dedups against what it cached: keep it private
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    })
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
           "-W", "ignore::UserWarning", str(CHECKS), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)


def test_sglang_hicache_backend_on_dir_hub_and_s3(sglang_venv: Path, hub_bucket: Any, seaweedfs: Any,
                                                   s3_bucket: str, tmp_path: Path) -> None:
    hub = hub_bucket.hub
    s3_opts = {k: v for k, v in seaweedfs.config(s3_bucket).items() if k != "s3_endpoint"}
    targets = {
        "dir": {"url": str(tmp_path / "store")},
        "hub": {"url": f"hf://buckets/{hub_bucket.bucket_id}",
                "options": {"token": hub.write_token, "endpoint": hub.endpoint, "token_env": "",
                            "retry_backoff_secs": 0.01}},
        "s3": {"url": f"s3://{s3_bucket}", "options": s3_opts},
    }
    proc = run_checks(sglang_venv, targets, tmp_path, "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == N_CHECKS * len(targets), out[-3000:]
    assert "skipped" not in out and "failed" not in out
    for name in targets:  # every check ran on every store
        assert len(re.findall(rf"^PASSED \S+\[{name}\]", out, re.M)) == N_CHECKS, out[-3000:]
    assert any((tmp_path / "store").rglob("*")), "the directory store holds no page"


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
