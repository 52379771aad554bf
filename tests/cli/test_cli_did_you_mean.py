"""Did-you-mean for every config key at every level, every enumerated option and every
``KVBUCKET_*`` variable (issue 31 item 10): a typo is named with the closest right spelling, and
a misspelt key is never reported as a missing one.

The CLI cases run the installed console script; the library cases go through each config
surface a user writes (engine YAML, plugin keys, L2 adapter specs, the LMCache connector's keys,
the engines' extra configs, store URLs' options).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

from kvbucket.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


# ---- the console script ----------------------------------------------------------------------------


def test_a_misspelt_plugin_key_is_named_not_reported_missing(cli_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("chunk_size: 256\nremote_storage_plugins: [\"hfbucket\"]\nextra_config:\n"
                   "  remote_storage_plugin.hfbucket.bucket_handel: \"hf://buckets/a/b\"\n")
    r = run_cli("demo", "--synthetic", "--chunks", "1", "--config", str(cfg), env=cli_env)
    line = assert_one_line_error(r, 2, "bucket_handel", "did you mean 'bucket_handle'?")
    assert "is required" not in line


@pytest.mark.parametrize(("args", "suggestion"), [
    (["compile-cache", "fetch", "--layout", "directroy"], "did you mean 'directory'?"),
    (["ls", ".", "--format", "jsn"], "did you mean 'json'?"),
    (["doctor", "--model", "llama-3.1-9b"], "did you mean 'llama-3.1-8b'?"),
])
def test_an_enumerated_option_suggests_the_closest_value(args: list[str], suggestion: str,
                                                         cli_env: dict[str, str], tmp_path: Path) -> None:
    r = run_cli(*args, env=cli_env, cwd=tmp_path)
    assert_one_line_error(r, 2, suggestion)


def test_an_unknown_kvbucket_variable_is_warned_once(cli_env: dict[str, str], tmp_path: Path) -> None:
    env = {**cli_env, "KVBUCKET_CHUNK_SIZ": "128", "KVBUCKET_NO_SUCH_THING": "1"}
    r = run_cli("ls", str(tmp_path), env=env)
    assert r.code == 0, r.err
    warnings = [ln for ln in r.err_lines if ln.startswith("warning: ")]
    assert len(warnings) == 2, r.err
    assert "KVBUCKET_CHUNK_SIZ" in warnings[0] and "did you mean KVBUCKET_CHUNK_SIZE?" in warnings[0]
    assert "KVBUCKET_NO_SUCH_THING" in warnings[1]
    r = run_cli("ls", str(tmp_path), env={**cli_env, "KVBUCKET_CHUNK_SIZE": "128"})  # a known one: silent
    assert r.code == 0 and not r.err_lines, r.err


def test_every_kvbucket_variable_the_code_reads_is_known() -> None:
    """The list behind the warning is complete: no variable the project reads is warned about."""
    from kvbucket.engine_config import EngineConfig
    from kvbucket.env_vars import known_variables

    used: set[str] = set()
    for where in ("src", "benchmarks", "engines"):
        for p in (ROOT / where).rglob("*"):
            if p.suffix in (".py", ".sh") and p.is_file():
                used |= set(re.findall(r"\bKVBUCKET_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(encoding="utf-8")))
    assert used, "no variable found: the scan is broken"
    assert used - known_variables(EngineConfig.model_fields) == set()


# ---- every config surface of the library --------------------------------------------------------------


def _engine(extra: dict[str, Any], **top: Any) -> None:
    from kvbucket.chunks import KVLayout
    from kvbucket.config import build_backend
    from kvbucket.engine_config import EngineConfig

    build_backend(EngineConfig.from_dict({"chunk_size": 256, **top, "extra_config": extra}),
                  KVLayout(2, 2, 8, "bfloat16")).close()


def _l2(spec: dict[str, Any]) -> None:
    from kvbucket.l2.registry import parse_l2_config

    parse_l2_config(spec)


def _connector(extra: dict[str, Any]) -> None:
    from kvbucket.integrations.lmcache.connector import connector_config_from_extra

    connector_config_from_extra(extra, "kvb")


def _vllm(entry: dict[str, Any]) -> None:
    from kvbucket.integrations.vllm import VLLMTierSettings

    VLLMTierSettings.from_tier_config(entry)


CASES = {
    "engine top-level key": (lambda: _engine({}, chunk_siz=1), "did you mean 'chunk_size'?"),
    "plugin key": (lambda: _engine({"remote_storage_plugin.hfbucket.bucket_handle": "hf://buckets/a/b",
                                    "remote_storage_plugin.hfbucket.num_workrs": 2},
                                   remote_storage_plugins=["hfbucket"]), "did you mean 'num_workers'?"),
    "plugin bucket_handle": (lambda: _engine({"remote_storage_plugin.hfbucket.bucket_handel": "hf://buckets/a/b"},
                                             remote_storage_plugins=["hfbucket"]),
                             "did you mean 'bucket_handle'?"),
    "plugin type": (lambda: _engine({}, remote_storage_plugins=["hfbuckt"]), "did you mean 'hfbucket'?"),
    "extra_config of the engine": (lambda: _engine({"unsealedd": "accept"}), "did you mean 'unsealed'?"),
    "extra_config.encryption": (lambda: _engine({"encryption": {"keyring_fil": "/x"}}),
                                "did you mean 'keyring_file'?"),
    "extra_config of an s3 remote_url": (lambda: _engine({"s3_regoin": "us-east-1"}, remote_url="s3://b/x"),
                                         "did you mean 's3_region'?"),
    "file store option": (lambda: __import__("kvbucket.stores", fromlist=["open_store"]).open_store(
        "file:///tmp/kvb-dym", fsnyc=True), "did you mean 'fsync'?"),
    "L2 adapter type": (lambda: _l2({"type": "hfbuckt"}), "did you mean 'hfbucket'?"),
    "L2 adapter field": (lambda: _l2({"type": "fs", "base_path": "/tmp/x", "evicton": {}}),
                         "did you mean 'eviction'?"),
    "L2 adapter nested field": (lambda: _l2({"type": "fs", "base_path": "/tmp/x", "fleet": {"nod_id": "a"}}),
                                "did you mean 'node_id'?"),
    "L2 adapter s3 field": (lambda: _l2({"type": "s3", "s3_endpoint": "s3://b", "s3_regoin": "x"}),
                            "did you mean 's3_region'?"),
    "LMCache connector bucket_handle": (lambda: _connector({"remote_storage_plugin.kvb.bucket_handel": "hf://x"}),
                                        "did you mean remote_storage_plugin.kvb.bucket_handle?"),
    "LMCache connector field": (lambda: _connector({"remote_storage_plugin.kvb.bucket_handle": "hf://buckets/a/b",
                                                    "remote_storage_plugin.kvb.num_workrs": 2}),
                                "did you mean 'num_workers'?"),
    "vLLM tier store_url": (lambda: _vllm({"store_rul": "hf://buckets/a/b"}), "did you mean 'store_url'?"),
    "vLLM tier field": (lambda: _vllm({"store_url": "/tmp/x", "cache_slat": "a"}),
                        "did you mean 'cache_salt'?"),
    "compile cache layout": (lambda: __import__("kvbucket.compile_cache.layout", fromlist=["x"]).get_layout(
        "directroy"), "did you mean 'directory'?"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_config_surface_suggests_the_key(case: str) -> None:
    make, suggestion = CASES[case]
    with pytest.raises(ConfigError) as e:
        make()
    assert suggestion in str(e.value), str(e.value)
    assert "is required" not in str(e.value)
