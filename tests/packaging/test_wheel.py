"""The wheel users install works without the repository, and the extras declare what the
integrations import.

``python -m build`` makes the sdist, then the wheel from the sdist (so a file missing from the
sdist fails here); the wheel goes into a new venv outside the repository, with no
``PYTHONPATH`` and a working directory elsewhere, pinned by constraints.txt. From that venv:
``kvbucket --version``, ``kvbucket emulator serve`` (a real Hub emulator process) and
``kvbucket demo --synthetic --chunks 2 --target hf://...`` against it, as a user would run them.

Then a new user's first steps (issue 31), replayed in the same venv against the same emulator:
``ls/du/verify --format json`` on a bucket id, ``stats --format json`` of a process that used a
store opened by its bucket id, ``rm --dry-run`` then ``rm``, ``-h``/``-V``, a typo in a config
key and a refused connection; each output is checked as the user reads it.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: kvbucket modules that need an extra, and the extra that must provide their imports
MODULE_EXTRAS = {
    "kvbucket/integrations/lmcache": "lmcache",  # a package: every module in it
    "kvbucket/encryption.py": "encryption",
    "kvbucket/integrations/transformers.py": "transformers",
    "kvbucket/integrations/transformers_model.py": "transformers",
    "kvbucket/demo/real_model.py": "transformers",
}
#: third-party imports no dependency or extra provides, and why
ENGINES = {
    "sglang": "SGLang is the engine kvbucket plugs into: users run kvbucket inside it (docs/sglang.md)",
    "vllm": "vLLM is the engine kvbucket plugs into: users run kvbucket inside it (docs/vllm.md)",
    "neuronx_cc": "the AWS Neuron compiler, present on Neuron instances only",
    "certifi": "optional (ImportError handled): stores/s3/direct.py falls back to libcurl's CA store",
    "triton": "optional (ImportError suppressed): compile_cache/torch_env.py names its version if present",
}


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "HF_", "AWS_", "KVBUCKET_"))}
    env.update(HOME=str(tmp / "home"), HF_HOME=str(tmp / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               KVBUCKET_CONFIG_DIR=str(tmp / "kvbucket-config"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    (tmp / "home").mkdir(exist_ok=True)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, \
        f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    print(f"{time.monotonic() - t0:6.1f} s  {' '.join(Path(c).name if '/' in c else c for c in cmd[:4])}")
    return p


@pytest.mark.slow(32)
def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path: Path) -> None:
    env = _clean_env(tmp_path)
    # pip's cache is the user's own (not the throwaway HOME), so wheels already fetched are reused
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    dist = tmp_path / "dist"
    # Without build isolation: the test venv's setuptools builds (a fresh isolated env per
    # artifact costs a minute here and tests pip, not kvbucket's packaging).
    _run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", str(dist),
          str(ROOT)], env, tmp_path, 300)
    version = PROJECT["version"]
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert [p.name for p in sdists] == [f"kvbucket-{version}.tar.gz"]
    assert [p.name for p in wheels] == [f"kvbucket-{version}-py3-none-any.whl"]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp_path, 120)
    bin_ = venv / "bin"
    # this interpreter's pip installs into the clean venv (pip --python): no pip copied into it
    _run([sys.executable, "-m", "pip", "--python", str(bin_ / "python"), "install", "-q", "--no-compile",
          "-c", str(ROOT / "constraints.txt"), str(wheels[0])], env, tmp_path, 600)
    probe = "import kvbucket, sys; print(kvbucket.__file__); print(sys.path)"
    where = _run([str(bin_ / "python"), "-c", probe], env, tmp_path, 60).stdout
    assert str(venv) in where.splitlines()[0], where
    assert str(ROOT) not in where, f"the repository is on the path of the clean venv: {where}"

    out = _run([str(bin_ / "kvbucket"), "--version"], env, tmp_path, 60).stdout
    assert version in out

    token = "hf_wheel_test_" + os.urandom(6).hex()
    serve_env = {**env, "KVBUCKET_EMULATOR_TOKENS": f"me={token}:write"}
    serve = [str(bin_ / "kvbucket"), "emulator", "serve", "--data-dir", str(tmp_path / "hub")]
    server = subprocess.Popen(serve, env=serve_env, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        assert line.startswith("HF_ENDPOINT=http://127.0.0.1:"), line
        endpoint = line.split("=", 1)[1]
        demo_env = {**env, "HF_ENDPOINT": endpoint, "HF_TOKEN": token}
        create = "from huggingface_hub import HfApi; HfApi().create_bucket('me/wheel-demo', private=True)"
        _run([str(bin_ / "python"), "-c", create], demo_env, tmp_path, 120)
        # 2 chunks of the default model (8 MiB each), not the default 32: the same store, load and
        # clean-up from the wheel; 256 MiB through the emulator cost ~20 s and checked nothing more
        demo = _run([str(bin_ / "kvbucket"), "demo", "--synthetic", "--chunks", "2", "--target",
                     "hf://buckets/me/wheel-demo"], demo_env, tmp_path, 300)
        text = demo.stdout + demo.stderr
        assert token not in text
        listed = _run([str(bin_ / "kvbucket"), "du", "hf://buckets/me/wheel-demo"], demo_env, tmp_path, 120)
        du = listed.stdout
        _new_user_steps(bin_, demo_env, tmp_path)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert token not in err
    assert "all bytes verified" in text, text[-2000:]
    assert du.startswith("0 objects"), f"the demo left chunks behind: {du}"  # --target: removed after


def _kv(bin_: Path, env: dict[str, str], cwd: Path, *args: str,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvbucket ARGS`` from the clean venv, whatever its exit status (the caller checks it)."""
    t0 = time.monotonic()
    p = subprocess.run([str(bin_ / "kvbucket"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    print(f"{time.monotonic() - t0:6.1f} s  kvbucket {' '.join(args)[:70]} -> exit {p.returncode}")
    return p


def _json_of(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, f"exit {p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}"
    return json.loads(p.stdout)


#: a user's process: a store opened by its bucket id, some traffic, its /metrics served
_STATS_PROCESS = """
import sys
from kvbucket.metrics import InstrumentedStore
from kvbucket.metrics_server import start_metrics_server
from kvbucket.stores import open_store
store = InstrumentedStore(open_store("me/wheel-demo/replay"), name="replay")
assert all(r.ok for r in store.put_many([("x.bin", b"x" * 100)]))
store.get_many(["x.bin", "missing.bin"])
print(start_metrics_server(0).port, flush=True)
sys.stdin.read()
"""

_TYPO_CONFIG = """\
chunk_size: 256
remote_storage_plugins: [hfbucket]
extra_config:
  remote_storage_plugin.hfbucket.bucket_handel: hf://buckets/me/wheel-demo
"""


def _new_user_steps(bin_: Path, env: dict[str, str], cwd: Path) -> None:
    """Issue 31's replay: what a user coming from `hf` types first, and what they must read."""
    assert _kv(bin_, env, cwd, "-V").stdout.startswith("kvbucket ")
    assert _kv(bin_, env, cwd, "ls", "-h").stdout.startswith("Usage: kvbucket ls ")
    # the demo's chunks kept under a prefix of the bucket, named by its bucket id
    demo = _kv(bin_, env, cwd, "demo", "--synthetic", "--chunks", "4", "--keep", "--target",
               "me/wheel-demo/kept", timeout=300)
    assert demo.returncode == 0 and "all bytes verified" in demo.stdout, demo.stdout[-2000:] + demo.stderr
    assert "remote = hf://buckets/me/wheel-demo/kept" in demo.stdout  # whole, though not a terminal
    listed = _json_of(_kv(bin_, env, cwd, "ls", "me/wheel-demo", "--format", "json"))
    assert isinstance(listed, list) and len(listed) >= 4, listed
    assert all(set(e) == {"name", "key", "size", "mtime"} and e["name"].startswith("kept/") for e in listed)
    du = _json_of(_kv(bin_, env, cwd, "du", "me/wheel-demo/kept", "--format", "json"))
    assert {k: du[k] for k in ("url", "prefix", "objects", "bytes", "fleet")} == {
        "url": "hf://buckets/me/wheel-demo/kept", "prefix": "", "objects": len(listed),
        "bytes": sum(e["size"] for e in listed), "fleet": None}, du
    verified = _json_of(_kv(bin_, env, cwd, "verify", "me/wheel-demo/kept", "--format", "json"))
    assert verified["totals"]["good"]["objects"] == len(listed) and verified["not_good"] == [], verified

    proc = subprocess.Popen([str(bin_ / "python"), "-c", _STATS_PROCESS], env=env, cwd=cwd, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read() if proc.stderr else port
        stats = _json_of(_kv(bin_, env, cwd, "stats", "--url", f"http://127.0.0.1:{port}/metrics",
                             "--format", "json"))
    finally:
        proc.communicate("", timeout=60)
    rows = {(r["kind"], r["name"]): r for r in stats["rows"]}
    assert (rows[("store", "replay")]["hits"], rows[("store", "replay")]["misses"]) == (1, 1), rows

    dry = _kv(bin_, env, cwd, "rm", "me/wheel-demo", "--prefix", "kept/", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1] == f"(dry run) would remove {len(listed)}", dry.stdout
    assert len(_json_of(_kv(bin_, env, cwd, "ls", "me/wheel-demo/kept", "--format", "json"))) == len(listed)
    gone = _kv(bin_, env, cwd, "rm", "me/wheel-demo", "--prefix", "kept/", "--yes")
    assert (gone.returncode, gone.stdout.strip()) == (0, f"removed {len(listed)}"), gone.stdout + gone.stderr
    left = _json_of(_kv(bin_, env, cwd, "ls", "me/wheel-demo", "--format", "json"))
    assert [e["name"] for e in left] == ["replay/x.bin"], left

    # a typo in a config key: one line naming it and the key meant, exit 2
    (cwd / "typo.yaml").write_text(_TYPO_CONFIG)
    typo = _kv(bin_, env, cwd, "demo", "--synthetic", "--chunks", "2", "--config", "typo.yaml")
    errors = [ln for ln in typo.stderr.splitlines() if ln.strip()]
    assert typo.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: "), typo.stderr
    assert "unknown option 'bucket_handel' (did you mean 'bucket_handle'?" in errors[0], errors
    assert "Traceback" not in typo.stderr

    # a refused connection: at once (not retried), one line naming the cause and the endpoint, exit 1,
    # no JSON on stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    refused = _kv(bin_, {**env, "HF_ENDPOINT": closed}, cwd, "ls", "me/wheel-demo", "--format", "json")
    errors = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr
    assert refused.stdout == "", refused.stdout
    assert f"connection refused by {closed}" in errors[0] and "not retried" in errors[0], errors
    assert f"check that {closed} ($HF_ENDPOINT) is up and reachable" in errors[0], errors


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return {t for t in tops if t != "kvbucket" and t not in sys.stdlib_module_names and t != "__future__"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


_PACKAGES = functools.cache(importlib.metadata.packages_distributions)


@functools.cache
def _distributions(module: str) -> set[str]:
    found = _PACKAGES().get(module, [module])
    return {d.lower().replace("_", "-") for d in found}


def test_each_extra_declares_what_its_integrations_import() -> None:
    base = _names(PROJECT["dependencies"])
    extras = {k: _names(v) for k, v in PROJECT["optional-dependencies"].items()}
    src = ROOT / "src"
    for rel, extra in MODULE_EXTRAS.items():
        missing = {}
        files = sorted((src / rel).rglob("*.py")) if (src / rel).is_dir() else [src / rel]
        assert files and all(f.is_file() for f in files), f"{rel}: moved? update MODULE_EXTRAS"
        imports = set().union(*(_third_party_imports(f) for f in files))
        assert extra != "lmcache" or "lmcache" in imports, f"{rel} no longer imports lmcache?"
        for mod in imports:
            if mod in ENGINES:
                continue
            dists = _distributions(mod)
            if not dists & (base | extras[extra]):
                missing[mod] = sorted(dists)
        assert not missing, f"{rel} imports {missing}, which neither the dependencies nor [{extra}] declare"
    # and every third-party import anywhere in kvbucket is declared somewhere (or is an engine)
    declared = base.union(*extras.values())
    stray = {}
    for path in sorted((src / "kvbucket").rglob("*.py")):
        if "testing" in path.parts:
            continue  # test helpers: the [test] extra and the repository's own tests
        for mod in _third_party_imports(path):
            if mod not in ENGINES and not _distributions(mod) & declared:
                stray[str(path.relative_to(src))] = mod
    assert not stray, f"imports no dependency or extra declares: {stray}"
