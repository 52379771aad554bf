"""Every part-size setting is spelt and refused alike (issue 41's outside tester): the S3 ones took
``8388608.0`` and refused ``"1_048_576"``, the Hub plugin's ``read_min_part_bytes`` the opposite.
One parser (stores/part_sizes.check_part_bytes) behind every surface: S3Config, the Hub's config,
its LMCache-style plugin options, the LMCache connector's extra_config, and the console script.
Spellings follow LMCache 0.5.6, which reads an int setting with Python's ``int(value)``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_one_line_error, run_cli

from kvbucket.errors import ConfigError
from kvbucket.integrations.lmcache.connector import connector_config_from_extra
from kvbucket.stores.hub.config import build_config, config_from_plugin_options
from kvbucket.stores.s3.config import S3Config

WORDS = "must be 0 (off) or a whole number of bytes from 65536 (64 KiB) to 1099511627776 (1 TiB)"


def _s3(key: str, value: Any) -> int:
    return int(getattr(S3Config.parse({"s3_endpoint": "s3://b", key: value}), key))


def _hub(key: str, value: Any) -> int:
    return int(getattr(build_config(bucket_handle="hf://buckets/o/b", **{key: value}), key))


def _hub_plugin(key: str, value: Any) -> int:
    cfg = config_from_plugin_options("hfbucket", {"bucket_handle": "hf://buckets/o/b", key: value})
    return int(getattr(cfg, key))


def _connector(handle: str) -> Callable[[str, Any], int]:
    def build(key: str, value: Any) -> int:
        p = "remote_storage_plugin.kv."
        cfg = connector_config_from_extra({p + "bucket_handle": handle, p + key: value}, "kv")
        return int(getattr(cfg, key))
    return build


SURFACES: list[tuple[str, str, Callable[[str, Any], int]]] = [
    (surface, key, fn)
    for surface, keys, fn in [
        ("S3Config", ("s3_read_part_bytes", "s3_read_min_part_bytes"), _s3),
        ("Hub config", ("read_part_bytes", "read_min_part_bytes"), _hub),
        ("Hub plugin options", ("read_part_bytes", "read_min_part_bytes"), _hub_plugin),
        ("LMCache connector, s3", ("s3_read_part_bytes", "s3_read_min_part_bytes"), _connector("s3://b/p")),
        ("LMCache connector, hub", ("read_part_bytes", "read_min_part_bytes"), _connector("hf://buckets/o/b")),
    ]
    for key in keys
]
IDS = [f"{s}:{k}" for s, k, _ in SURFACES]


@pytest.mark.parametrize(("surface", "key", "build"), SURFACES, ids=IDS)
@pytest.mark.parametrize(("value", "expected"), [
    (1 << 20, 1 << 20), (8388608.0, 8 << 20), ("1_048_576", 1 << 20), (" 8388608 ", 8 << 20), ("0", 0),
    (0.0, 0),
])
def test_every_part_size_setting_takes_what_lmcache_int_takes(
        surface: str, key: str, build: Callable[[str, Any], int], value: object, expected: int) -> None:
    assert build(key, value) == expected


@pytest.mark.parametrize(("surface", "key", "build"), SURFACES, ids=IDS)
@pytest.mark.parametrize("value", ["8MiB", 8388608.5, "8388608.0", True, 4096, None])
def test_every_part_size_setting_refuses_in_the_same_words(
        surface: str, key: str, build: Callable[[str, Any], int], value: object) -> None:
    """Refused values (a unit, a fraction of a byte ``int()`` would silently drop, a boolean, below
    64 KiB) name the key and the range in one wording, whichever surface."""
    with pytest.raises(ConfigError) as e:
        build(key, value)
    assert key in str(e.value) and WORDS in str(e.value), str(e.value)
    assert str(e.value).count(key) == 1, str(e.value)  # named once (was "k: k must be ...")
    assert "must be a number" not in str(e.value) and "valid integer" not in str(e.value)


@pytest.mark.parametrize("value", ["8MiB", "8388608.5"])
def test_the_console_script_refuses_a_part_size_alike_for_s3_and_the_hub(value: str, cli_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """Where a user sees it: ``kvbucket demo --config`` with the Hub plugin's and an s3 remote_url's
    part size set the same wrong way says the same words (before: "must be a number" or "Input
    should be a valid integer" for the Hub, the range for S3)."""
    hub = tmp_path / "hub.yaml"
    hub.write_text("chunk_size: 256\nremote_storage_plugins: [\"hfbucket\"]\nextra_config:\n"
                   "  remote_storage_plugin.hfbucket.bucket_handle: \"hf://buckets/a/b\"\n"
                   f"  remote_storage_plugin.hfbucket.read_min_part_bytes: {value}\n")
    s3 = tmp_path / "s3.yaml"
    s3.write_text("chunk_size: 256\nremote_url: \"s3://b/x\"\nextra_config:\n"
                  "  s3_endpoint_url: \"http://127.0.0.1:9\"\n"
                  f"  s3_read_min_part_bytes: {value}\n")
    for cfg, key in ((hub, "read_min_part_bytes"), (s3, "s3_read_min_part_bytes")):
        r = run_cli("demo", "--synthetic", "--chunks", "1", "--config", str(cfg), env=cli_env)
        assert_one_line_error(r, 2, key, WORDS, value)
