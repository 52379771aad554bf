"""README's ``lmcache server`` command, run as written through the real server, keeps its bucket
under ``max_capacity_gb`` (issue 40).

The command is read from README.md itself: its ``--l2-adapter`` JSON sets ``max_capacity_gb`` and
no ``"eviction"`` key anywhere, so LMCache's own L2 eviction controller has no adapter
(``_should_enable_l2_eviction`` needs the plugin spec's top-level ``"eviction"``) and only
kvbucket's default policy bounds the bucket. What the test changes, and why: the bucket handle
(a fresh bucket on the Hub emulator, which ``create_bucket_if_missing`` creates; ``HF_ENDPOINT``
and ``HF_TOKEN`` in the environment, as a user's shell has them), ``max_capacity_gb`` (tiny),
``--l1-size-gb`` (0.05 on a shared test machine), and the harness's ports, chunk size and
transfer mode. LMCache's own MP client (what vLLM's ``LMCacheMPConnector`` runs) then stores
more than three times the capacity.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from lmcache_server import Server

from kvbucket.l2 import open_l2_adapter
from kvbucket.testing.hub_fixtures import RunningHub
from kvbucket.testing.lmcache_mp import BLOCK, MPEngine

pytestmark = pytest.mark.lmcache

README = Path(__file__).resolve().parents[2] / "README.md"
CHUNK = 2 * 2 * BLOCK * 2 * 16 * 2  # MPEngine's 2 layers of [2, block, 2 heads, 16] bf16 per chunk
CAPACITY_CHUNKS = 12
REQUESTS, BLOCKS = 10, 4  # 40 chunks stored: 3.3x the capacity


def readme_lmcache_command() -> list[str]:
    """The arguments after ``lmcache server`` of README's first ``lmcache server`` command."""
    text = README.read_text()
    block = re.search(r"```bash\n(lmcache server .*?)\n(?:vllm|```)", text, re.S)
    assert block, "README.md has no ```bash block starting with `lmcache server`"
    argv = shlex.split(block.group(1))
    assert argv[:2] == ["lmcache", "server"]
    return argv[2:]


def adapter_spec(argv: list[str]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--l2-adapter") + 1])


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


def test_readme_lmcache_command_keeps_the_bucket_under_its_capacity(
    hub_emulator: RunningHub, tmp_path: Path, servers: list[Server]
) -> None:
    argv = readme_lmcache_command()
    spec = adapter_spec(argv)
    params = spec["adapter_params"]
    # the README's command as a user copies it: a capacity, no eviction setting at either level
    assert params["max_capacity_gb"] > 0 and "eviction" not in params and "eviction" not in spec
    bucket = f"{hub_emulator.namespace}/lmcache-kv-{secrets.token_hex(4)}"
    capacity = CAPACITY_CHUNKS * CHUNK
    params.update(bucket_handle=f"hf://buckets/{bucket}/prod", max_capacity_gb=capacity / 1024**3)
    if "model_identity" in params:  # the README's /models/... stands for the served model's directory
        from kvbucket.testing.identity_models import make_model_dirs

        params["model_identity"] = str(make_model_dirs(tmp_path / "models")["base"])
    argv[argv.index("--l2-adapter") + 1] = json.dumps(spec)
    argv[argv.index("--l1-size-gb") + 1] = "0.05"
    env = {"HF_ENDPOINT": hub_emulator.endpoint, "HF_TOKEN": hub_emulator.write_token}

    srv = Server([], tmp_path / "server.log", argv=argv, env=env)
    servers.append(srv)
    srv.wait_ready()
    [status] = srv.adapters()
    assert status["eviction_policy"] == "LRU" and status["capacity_bytes"] == capacity

    engine = MPEngine(f"tcp://127.0.0.1:{srv.port}", "org/readme-model", blocks=BLOCKS)
    peak = 0
    try:
        for r in range(REQUESTS):
            tokens = list(range(10_000 * (r + 1), 10_000 * (r + 1) + BLOCKS * BLOCK))  # new chunks
            engine.store(tokens, list(range(BLOCKS)))
            deadline = time.monotonic() + 60
            while True:  # until this request's chunks reached L2 (kept or already evicted)
                [a] = srv.adapters()
                peak = max(peak, a["bytes_used"])
                if a["keys"] + a["evicted_keys"] >= (r + 1) * BLOCKS or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert a["keys"] + a["evicted_keys"] == (r + 1) * BLOCKS, a
    finally:
        engine.close()
    srv.stop()
    assert peak <= capacity, f"the adapter held {peak} bytes in a {capacity}-byte capacity"
    assert a["evicted_keys"] >= REQUESTS * BLOCKS - CAPACITY_CHUNKS
    # the bucket itself, listed after the server stopped: under the capacity
    handle = f"hf://buckets/{bucket}/prod"
    token = hub_emulator.write_token
    same = {k: params[k] for k in ("model_identity",) if k in params}  # the chunks' identity: its reader
    with open_l2_adapter({"type": "hfbucket", "bucket_handle": handle, "endpoint": hub_emulator.endpoint,
                          "token": token, **same}) as check:  # fmt: skip
        assert check.wait_until_rebuilt(60)
        held = check.get_usage().bytes_used
    assert 0 < held <= capacity, f"the bucket holds {held} bytes in a {capacity}-byte capacity"
    assert 3 * capacity < REQUESTS * BLOCKS * CHUNK


def test_a_bad_adapter_field_ends_lmcaches_startup_traceback_with_kvbuckets_line(tmp_path: Path) -> None:
    """docs/l2.md quotes what `lmcache server` prints for a bad ``adapter_params`` field: its
    startup traceback (tens of lines) whose last error line is kvbucket's, then a non-zero exit."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "l2.md").read_text()
    quoted = re.search(r"```text\n(kvbucket\.errors\.ConfigError: L2 adapter .*?)\n", doc)
    assert quoted, "docs/l2.md no longer quotes the ConfigError line"
    params = {"type": "hfbucket", "bucket_handle": "hf://buckets/my-org/kv", "num_workers": "8"}
    argv = ["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter",
            json.dumps({"type": "plugin", "module_path": "kvbucket.integrations.lmcache",
                        "class_name": "KVBucketL2Adapter", "adapter_params": params})]  # fmt: skip
    srv = Server([], tmp_path / "server.log", argv=argv, env={"LMCACHE_DISABLE_BANNER": "1"})
    try:
        assert srv.proc.wait(120) != 0
    finally:
        srv.stop()
    out = re.sub(r"\x1b\[[0-9;]*m", "", srv.log.read_text())
    assert quoted.group(1) in out
    tail = out[out.index("Traceback"):].splitlines()
    assert len(tail) > 20 and [ln for ln in tail if ln.startswith("kvbucket.errors.ConfigError")] == [
        quoted.group(1)]
    assert "Application startup failed" in out
