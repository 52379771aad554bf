"""Run checks inside a serving engine's own venv (``engines/venv.sh <engine>``).

The engines pin other torch builds than kvbucket's test venv, so their checks run in a venv of
their own, built once per set of pins and cached. The outer test (in kvbucket's venv) owns the
servers (Hub emulator, SeaweedFS) and hands their addresses to the checks as JSON in an
environment variable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def engine_venv(root: Path, engine: str) -> Path:
    """Build or reuse the engine's venv (minutes the first time on a machine, then cached)."""
    proc = subprocess.run(["bash", str(root / "engines" / "venv.sh"), engine], capture_output=True,
                          text=True, timeout=3000)
    if proc.returncode != 0:
        raise AssertionError(f"engines/venv.sh {engine} failed:\n{proc.stderr[-4000:]}")
    venv = Path(proc.stdout.strip().splitlines()[-1])
    if not (venv / ".complete").exists():
        raise AssertionError(f"{venv} is not a complete venv")
    return venv


def store_targets(tmp_path: Path, hub_bucket: Any, seaweedfs: Any, s3_bucket: str) -> dict[str, Any]:
    """A directory, a Hub emulator bucket and a SeaweedFS bucket, as ``{name: {"url", "options"}}``."""
    hub = hub_bucket.hub
    s3_opts = {k: v for k, v in seaweedfs.config(s3_bucket).items() if k != "s3_endpoint"}
    return {
        "dir": {"url": str(tmp_path / "store")},
        "hub": {"url": f"hf://buckets/{hub_bucket.bucket_id}",
                "options": {"token": hub.write_token, "endpoint": hub.endpoint, "token_env": "",
                            "retry_backoff_secs": 0.01}},
        "s3": {"url": f"s3://{s3_bucket}", "options": s3_opts},
    }


#: A Hub fleet evicts no chunk younger than twice ``recheck_delay_secs`` (stores/hub/rechecks.py):
#: the engine checks' fleets on the Hub use 2.5 s, not the default 5 (the delete window stays at its
#: default 2, as in tests/integrity), so their evictions come 5 s sooner.
FLEET_HUB_RECHECK_DELAY = 2.5


def fleet_target(target: dict[str, Any]) -> dict[str, Any]:
    """``target`` in a fleet of its own (a fresh sub-store of it); on the Hub with
    :data:`FLEET_HUB_RECHECK_DELAY`."""
    import uuid

    sub = {**target, "url": f"{target['url']}/fleet-{uuid.uuid4().hex[:8]}"}
    if sub["url"].startswith("hf://"):
        sub["options"] = {**sub.get("options", {}), "recheck_delay_secs": FLEET_HUB_RECHECK_DELAY}
    return sub


def run_checks(venv: Path, root: Path, checks: Path, env_var: str, targets: dict[str, Any], tmp_path: Path,
               *args: str) -> subprocess.CompletedProcess[str]:
    """Run the pytest file ``checks`` with the engine venv's Python; ``targets`` go in ``env_var``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "PYTEST_"))}
    env.update({
        "PYTHONPATH": str(root / "src"),
        env_var: json.dumps(targets),
        "HF_XET_CACHE": str(tmp_path / "xet"),  # hf_xet dedups against what it cached: keep it private
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    })
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
           "-W", "ignore::UserWarning", str(checks), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)


def assert_all_passed(proc: subprocess.CompletedProcess[str], n_checks: int, targets: dict[str, Any],
                      shared: tuple[str, ...] = ()) -> str:
    """Every check passed on every store (run with ``-rA``): ``n_checks`` checks parametrized by
    store, and the ``shared`` checks (by name) that run once over every store; returns the output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == n_checks * len(targets) + len(shared), out[-3000:]
    # pytest's summary counts (not the word in captured logs, e.g. vLLM's "host_register failed", nor a
    # name ending in digits: "...-8c885d9a7a8c1870 failed: S3 list ...").
    assert not re.search(r"\b\d+ (failed|skipped|errors?|xfailed|xpassed)\b", out), out[-3000:]
    for name in targets:
        assert len(re.findall(rf"^PASSED \S+\[{name}\]", out, re.M)) == n_checks, out[-3000:]
    for check in shared:
        assert re.search(rf"^PASSED \S+::{check}$", out, re.M), (check, out[-3000:])
    return out



def target_listing(target: dict[str, Any]) -> dict[str, int]:
    """Name -> size of every object under ``target``'s prefix (a check's before/after of a store)."""
    from kvbucket.stores import open_store

    store = open_store(target["url"], **target.get("options", {}))
    try:
        return {i.name: i.size for i in store.list(target["prefix"] + "/")}
    finally:
        store.close()


@contextlib.contextmanager
def store_servers(names: Iterable[str], tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Targets like :func:`store_targets` outside pytest (benchmarks): ``dir``, ``hub`` (the Hub
    emulator in its own process, a private bucket) and ``s3`` (SeaweedFS, a fresh bucket), as
    asked; servers on 127.0.0.1, stopped on exit."""
    names = list(names)
    with contextlib.ExitStack() as stack:
        targets: dict[str, Any] = {}
        if "dir" in names:
            targets["dir"] = {"url": str(tmp_path / "store")}
        if "hub" in names:
            from kvbucket.testing.hub_emulator import HubEmulator

            token = "hf_bench_" + os.urandom(8).hex()
            emu = stack.enter_context(HubEmulator(tokens={"bench": (token, "write")}, subprocess=True))
            targets["hub"] = {"url": "hf://buckets/bench/engines",
                              "options": {"token": token, "endpoint": emu.endpoint, "token_env": "",
                                          "create_bucket_if_missing": True}}
        if "s3" in names:
            from kvbucket.testing.s3_server import SeaweedFS

            server = stack.enter_context(SeaweedFS())
            bucket = server.create_bucket()
            opts = {k: v for k, v in server.config(bucket).items() if k != "s3_endpoint"}
            targets["s3"] = {"url": f"s3://{bucket}", "options": opts}
        unknown = set(names) - set(targets)
        if unknown:
            raise ValueError(f"unknown stores {sorted(unknown)}; known: dir, hub, s3")
        yield targets


def reexec_in_engine_venv(root: Path, engine: str, argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` (a script and its arguments) with the engine venv's Python, kvbucket's src on
    its path; returns the exit code."""
    venv = engine_venv(root, engine)
    full = {**os.environ, **env, "PYTHONPATH": str(root / "src")}
    return subprocess.call([str(venv / "bin" / "python"), *argv], env=full)


#: The environment variable a benchmark re-run in an engine venv finds its store targets in.
BENCH_TARGETS_ENV = "KVB_BENCH_TARGETS"


def bench_in_engine_venv(root: Path, engine: str, stores: str, argv: list[str]) -> None:
    """For a benchmark script: return when ``engine`` imports here (it runs in the engine's venv);
    otherwise start the servers of ``stores`` (comma-separated: dir, hub, s3), re-run ``argv`` in
    the engine's venv with their targets in ``$KVB_BENCH_TARGETS``, and exit with its status."""
    if importlib.util.find_spec(engine) is not None:
        return
    with tempfile.TemporaryDirectory(prefix=f"bench-{engine}-") as tmp, \
            store_servers(stores.split(","), Path(tmp)) as targets:
        env = {BENCH_TARGETS_ENV: json.dumps(targets), "HF_XET_CACHE": f"{tmp}/xet", "HF_HOME": f"{tmp}/hf"}
        code = reexec_in_engine_venv(root, engine, argv, env)
    sys.exit(code)


_DECODER_CHECK = """
import lz4.frame
import numpy as np
import llvmlite, numba
from kvbucket.stores.hub.xet import kernel
from kvbucket.stores.hub.xet.decode import compiled

k = compiled()
assert k is not None and k.run is kernel.decode_run, "the compiled Xet decoder did not load"
payload = bytes(range(256)) * 64
chunks = b""
for scheme, body in ((0, payload), (1, lz4.frame.compress(payload))):  # raw, then one LZ4 frame
    n, u = len(body), len(payload)
    chunks += bytes([0, n & 255, n >> 8 & 255, n >> 16, scheme, u & 255, u >> 8 & 255, u >> 16]) + body
win = np.frombuffer(bytearray(chunks), dtype=np.uint8)
out = np.zeros(2 * len(payload), dtype=np.uint8)
info = np.zeros(5, dtype=np.int64)
k.run(k.lz4, win, 0, len(win), 2, out, 0, len(out), np.zeros(len(payload), dtype=np.uint8), 1 << 20, info)
assert info[3] == kernel.DONE and info[1] == 2 and out.tobytes() == payload * 2, info
print("numba", numba.__version__, "llvmlite", llvmlite.__version__)
"""


def check_compiled_decoder(venv: Path, root: Path) -> str:
    """Load kvbucket's compiled Xet decoder in an engine venv and decode a raw and an LZ4 chunk
    with it (numba and llvmlite installed from kvbucket's metadata); returns its versions line."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVBUCKET_XET_DECODER", "PYTHONPATH")}
    env["PYTHONPATH"] = str(root / "src")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", _DECODER_CHECK], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()
