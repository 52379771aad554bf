"""``kvbucket rm`` on a Hub bucket says that a name a running writer just committed comes back
(issue 39; docs/cli.md "Removing objects"), and it does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_run import run_cli

from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore

NOTE = "note: a name a running writer committed less than its recheck_delay_secs (default 5 s) ago comes back"


def test_rm_on_a_hub_bucket_says_a_just_written_name_comes_back(tmp_path: Path, cli_env: dict[str, str],
                                                                hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    writer = HFBucketStore(HFBucketConfig(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}", token=hub.write_token, endpoint=hub.endpoint,
        metadata_cache_ttl_secs=0, delete_window_secs=1.0, recheck_delay_secs=2.0))
    try:
        writer.put("chunk", b"just written by a live engine")
        env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token}
        r = run_cli("rm", f"hf://buckets/{hub_bucket.bucket_id}", "chunk", env=env, cwd=tmp_path)
        assert r.code == 0, r.err
        assert r.err_lines[-1].startswith(NOTE), r.err  # after removing, on stderr
        assert r.out.strip() == "removed 1"
        assert writer.rechecks.settle() == 1
        assert writer.get("chunk") == b"just written by a live engine"  # as the note said
    finally:
        writer.close()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"1")
    r = run_cli("rm", "./d", "x", env=cli_env, cwd=tmp_path)
    assert r.code == 0 and NOTE not in r.err, r.err  # a directory has no writer re-checks
