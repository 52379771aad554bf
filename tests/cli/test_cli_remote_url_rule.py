"""One rule for a configured remote URL (issue 40, outside tester F3).

``KVBUCKET_REMOTE_URL=bob/kv``: ``doctor`` checked the Hub bucket bob/kv while the engine (and
``demo --config``) wrote a local ./bob/kv. Now an engine's ``remote_url`` reads a bare bucket id
as the CLI does (stores/urls.py), and refuses text that is also an existing local path, naming
both spellings (as ``rm`` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_run import run_cli

from kvbucket.stores import open_store


def test_a_bare_bucket_id_is_the_hub_bucket_for_the_engine_demo_and_doctor(
    hub_bucket: Any, cli_env: dict[str, str], tmp_path: Path
) -> None:
    hub = hub_bucket.hub
    config = tmp_path / "engine.yaml"
    config.write_text("chunk_size: 256\nremote_url: file:///nonexistent/ignored\n")
    env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token,
           "KVBUCKET_REMOTE_URL": f"{hub_bucket.bucket_id}/demo"}  # fmt: skip
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--config", str(config),
                "--keep", env=env, cwd=tmp_path)
    assert r.code == 0, (r.out, r.err)
    assert f"hf://buckets/{hub_bucket.bucket_id}/demo" in " ".join(r.out.split()), r.out
    assert not (tmp_path / hub_bucket.bucket_id.split("/")[0]).exists(), "wrote a local directory"
    store = open_store(f"hf://buckets/{hub_bucket.bucket_id}", token=hub.write_token, endpoint=hub.endpoint)
    try:
        assert any(o.name.startswith("demo/") for o in store.list("")), "nothing stored in the bucket"
    finally:
        store.close()
    d = run_cli("doctor", env=env, cwd=tmp_path, timeout=60)
    assert f"hf://buckets/{hub_bucket.bucket_id}/demo ($KVBUCKET_REMOTE_URL)" in d.out, d.out


def test_a_bucket_id_that_is_also_a_local_path_is_refused_naming_both(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "bob").mkdir()
    config = tmp_path / "engine.yaml"
    config.write_text("chunk_size: 256\nremote_url: bob/kv\n")
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--config", str(config),
                env=cli_env, cwd=tmp_path)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "./bob/kv" in r.err and "hf://buckets/bob/kv" in r.err, r.err
    assert "Traceback" not in r.err
    d = run_cli("doctor", env={**cli_env, "KVBUCKET_REMOTE_URL": "bob/kv"}, cwd=tmp_path, timeout=60)
    assert "./bob/kv" in d.out and "hf://buckets/bob/kv" in d.out and "FAIL" in d.out, d.out
