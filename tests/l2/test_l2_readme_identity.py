"""The README's LMCache (MP) command, run as written: the real ``lmcache server`` with the
README's adapter params (the bucket pointed at the Hub emulator, ``model_identity`` at a model
directory standing for the README's ``/models/...``), and LMCache's own MP client storing under
that directory's name, as ``vllm serve /models/...`` does. No name-only warning is logged; every
chunk name carries the directory's identity; the first writer records its manifest, which ``du``
then shows (issue 38)."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from test_l2_lmcache_server import Server, hf_params, wait_keys

from kvbucket.identity.core import identity_of_dir
from kvbucket.identity.manifest import read_identities
from kvbucket.stores import open_store
from kvbucket.testing.hub_fixtures import HubBucket
from kvbucket.testing.identity_models import make_model_dirs
from kvbucket.testing.lmcache_mp import BLOCK, MPEngine

pytestmark = pytest.mark.lmcache
ROOT = Path(__file__).resolve().parents[2]


def readme_adapter_params() -> dict[str, object]:
    """The ``--l2-adapter`` JSON of the README's ``lmcache server`` line: its adapter_params."""
    text = (ROOT / "README.md").read_text()
    block = text.split("**LMCache, MP mode**", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line = re.search(r"lmcache server .*?(?=\nvllm )", block, re.S)
    assert line is not None, block
    argv = shlex.split(line.group(0).replace("\n", " "))
    spec = json.loads(argv[argv.index("--l2-adapter") + 1])
    return dict(spec["adapter_params"])


def test_the_readme_lmcache_command_keys_chunks_by_identity(hub_bucket: HubBucket, tmp_path: Path) -> None:
    params = readme_adapter_params()
    assert str(params["model_identity"]).startswith("/models/"), "the README names the served model directory"
    model = make_model_dirs(tmp_path / "models")["base"]
    params.update(hf_params(hub_bucket), model_identity=str(model))  # the emulator's bucket, a real model dir
    srv = Server([params], tmp_path / "server.log")  # as --l2-adapter '{"type": "plugin", ...}'
    try:
        srv.wait_ready()
        engine = MPEngine(f"tcp://127.0.0.1:{srv.port}", str(model))  # vllm serve <the directory>
        try:
            engine.store(list(range(1000, 1000 + 4 * BLOCK)), [0, 1, 2, 3])
            wait_keys(srv, [4])
        finally:
            engine.close()
    finally:
        srv.stop()
    token = identity_of_dir(model, str(model)).token
    store = open_store(str(params["bucket_handle"]), token=hub_bucket.hub.write_token,
                       endpoint=hub_bucket.hub.endpoint)
    try:
        names = [i.name for i in store.list("") if "_identity" not in i.name]
        assert len(names) == 4 and all(f"~{token}@" in n for n in names), names
        deadline = time.monotonic() + 30
        while not (seen := read_identities(store, "", str(model))):
            assert time.monotonic() < deadline, "no manifest"
            time.sleep(0.1)
        assert set(seen) == {token} and str(seen[token]["weights"]).startswith("files:")
    finally:
        store.close()
    log = srv.log.read_text()
    assert "by model name only" not in log, log[-3000:]
