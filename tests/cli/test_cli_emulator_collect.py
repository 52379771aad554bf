"""``kvbucket emulator collect`` and ``serve --xorb-grace``, run as a user would (issue 40 item 8)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cli_run import assert_one_line_error, run_cli
from huggingface_hub import HfApi

from kvbucket.testing import HubEmulator

ADMIN = "collect-admin-key-0123"


def test_collect_drops_unreferenced_xorbs_keeps_live_files(tmp_path: Path, cli_env: dict[str, str]) -> None:
    with HubEmulator(tmp_path / "data", admin_key=ADMIN) as emu:
        endpoint = emu.endpoint
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/cli")
        keep = os.urandom(200_000)
        api.batch_bucket_files("local/cli", add=[(os.urandom(200_000), "gone")])
        api.batch_bucket_files("local/cli", add=[(keep, "kept")])
        api.batch_bucket_files("local/cli", delete=["gone"])
        env = {**cli_env, "KVBUCKET_EMULATOR_ADMIN_KEY": ADMIN}
        r = run_cli("emulator", "collect", "--endpoint", emu.endpoint, env=env)
        assert r.code == 0, r.err
        assert json.loads(r.out)["unreferenced_kept"] == 1  # the server's default grace: 22 days
        r = run_cli("emulator", "collect", "--endpoint", emu.endpoint, "--grace", "0", env=env)
        assert r.code == 0, r.err
        done = json.loads(r.out)
        assert (done["xorbs"], done["grace_s"]) == (1, 0)
        api.download_bucket_files("local/cli", [("kept", tmp_path / "kept")])
        assert (tmp_path / "kept").read_bytes() == keep

        r = run_cli("emulator", "collect", "--endpoint", emu.endpoint, env=cli_env)
        assert_one_line_error(r, 2, "KVBUCKET_EMULATOR_ADMIN_KEY")
        r = run_cli("emulator", "collect", "--endpoint", emu.endpoint,
                    env={**cli_env, "KVBUCKET_EMULATOR_ADMIN_KEY": "wrong-key-123"})
        assert_one_line_error(r, 1, "403", "admin key")
    r = run_cli("emulator", "collect", "--endpoint", endpoint, env=env)  # stopped
    assert_one_line_error(r, 1, "cannot reach the emulator")


def test_serve_refuses_a_negative_xorb_grace(tmp_path: Path, cli_env: dict[str, str]) -> None:
    r = run_cli("emulator", "serve", "--data-dir", str(tmp_path / "hub"), "--xorb-grace", "-1",
                env=cli_env, timeout=60)
    assert r.code == 2 and "--xorb-grace" in r.err, r.err
