"""At home for ``hf`` users (issue 31, items 1-6), run as the installed ``kvbucket`` script.

Bucket ids (``ns/bucket[/prefix]``) wherever a URL is taken, ``--format table|json``, tables
not cut when the output is not a terminal, ``rm --dry-run`` and ``rm`` by the key ``ls --keys``
prints, ``-h`` and ``-V``, and progress lines on long work in a log.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

import kvbucket
from kvbucket.keys import CacheEngineKey, key_to_name
from kvbucket.stores import open_store
from kvbucket.stores.local.file import FileStore

KEY = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, -0x41257AF1DD85C366, "bfloat16")


@pytest.fixture
def hub_env(hub_bucket: Any, cli_env: dict[str, str]) -> dict[str, str]:
    hub = hub_bucket.hub
    return {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.write_token}


@pytest.fixture
def filled_bucket(hub_bucket: Any) -> str:
    """The bucket's id, holding two objects under kv/ and one at the top."""
    hub = hub_bucket.hub
    with open_store(f"hf://buckets/{hub_bucket.bucket_id}", endpoint=hub.endpoint, token=hub.write_token,
                    token_env="", prestart=False) as store:
        for r in store.put_many([("kv/a.bin", b"a" * 10), ("kv/b.bin", b"b" * 20), ("top.bin", b"t")]):
            assert r.ok, r.error
    return str(hub_bucket.bucket_id)


# ---- 1. bucket ids ------------------------------------------------------------------------

def test_the_rule_that_tells_a_bucket_id_from_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbucket.stores.urls import resolve_store_url

    monkeypatch.chdir(tmp_path)
    assert resolve_store_url("alice/kv") == "hf://buckets/alice/kv"
    assert resolve_store_url("alice/kv/llama/v1") == "hf://buckets/alice/kv/llama/v1"
    for local in ("./alice/kv", "/abs/dir", "../x/y", "~/cache/kv", "cache", ".", "my dir/x", "-bad/name",
                  "s3://b/p", "file:///d", "hf://buckets/a/b"):
        assert resolve_store_url(local) == local, local
    (tmp_path / "alice").mkdir()  # an existing local path wins
    assert resolve_store_url("alice/kv") == "alice/kv"


def test_ls_du_take_a_bucket_id_as_hf_buckets_list_does(filled_bucket: str, hub_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    r = run_cli("ls", filled_bucket, env=hub_env, cwd=tmp_path)
    assert r.code == 0, r.err
    assert [ln.split()[1] for ln in r.out.splitlines()] == ["kv/a.bin", "kv/b.bin", "top.bin"]
    r = run_cli("du", f"{filled_bucket}/kv", env=hub_env, cwd=tmp_path)
    assert r.code == 0, r.err
    assert r.out.startswith(f"2 objects, 30 bytes (30 B) in hf://buckets/{filled_bucket}/kv"), r.out
    # ./ns/bucket is always the local directory: here it does not exist
    r = run_cli("ls", f"./{filled_bucket}", env=hub_env, cwd=tmp_path)
    assert r.code == 2 and "does not exist" in r.err, r.err


def test_a_missing_bucket_id_says_how_it_was_read(hub_emulator: Any, hub_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    r = run_cli("ls", f"{hub_emulator.namespace}/no-such-bucket", env=hub_env, cwd=tmp_path)
    assert r.code == 2, r.err
    assert f"read as the Hub bucket id hf://buckets/{hub_emulator.namespace}/no-such-bucket" in r.err
    assert f"./{hub_emulator.namespace}/no-such-bucket for a local directory" in r.err


def test_the_library_opens_a_bucket_id_too(filled_bucket: str, hub_bucket: Any,
                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    hub = hub_bucket.hub
    with open_store(filled_bucket, endpoint=hub.endpoint, token=hub.write_token, token_env="",
                    prestart=False) as store:
        assert store.url == f"hf://buckets/{filled_bucket}"
        assert sorted(i.name for i in store.list("kv/")) == ["kv/a.bin", "kv/b.bin"]


# ---- 2. --format json ------------------------------------------------------------------------

def test_ls_du_verify_format_json(filled_bucket: str, hub_env: dict[str, str], tmp_path: Path) -> None:
    r = run_cli("ls", filled_bucket, "--format", "json", env=hub_env, cwd=tmp_path)
    assert r.code == 0, r.err
    entries = json.loads(r.out)
    assert [(e["name"], e["size"], e["key"]) for e in entries] == [
        ("kv/a.bin", 10, None), ("kv/b.bin", 20, None), ("top.bin", 1, None)]
    assert all(set(e) == {"name", "key", "size", "mtime"} for e in entries)
    r = run_cli("ls", filled_bucket, "-q", "--prefix", "kv/", env=hub_env, cwd=tmp_path)
    assert r.out.splitlines() == ["kv/a.bin", "kv/b.bin"]
    r = run_cli("du", filled_bucket, "--json", env=hub_env, cwd=tmp_path)
    du = json.loads(r.out)
    assert {k: du[k] for k in ("url", "prefix", "objects", "bytes", "fleet")} == {
        "url": f"hf://buckets/{filled_bucket}", "prefix": "", "objects": 3, "bytes": 31, "fleet": None}
    r = run_cli("verify", filled_bucket, "--format", "json", env=hub_env, cwd=tmp_path)
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["objects"] == 3 and doc["totals"]["legacy"] == {"objects": 3, "bytes": 31}
    assert {b["name"] for b in doc["not_good"]} == {"kv/a.bin", "kv/b.bin", "top.bin"}
    assert doc["wrong_url"] is None and doc["removed"] == 0


def test_doctor_and_compile_cache_status_format_json(cli_env: dict[str, str], tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    r = run_cli("doctor", str(store_dir), "--format", "json", env=cli_env)
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["versions"]["kvbucket"] == kvbucket.__version__
    # the token line comes first, always (doctor says which token it checked, or that there is none)
    checks = [(c["what"].split()[0], c["ok"]) for c in doc["checks"]]
    assert checks == [("token", True), (str(store_dir), True)]
    cache = tmp_path / "torch-cache"
    cache.mkdir()
    for flag in (["--format", "json"], ["--json"]):  # --json stays, as the same thing
        r = run_cli("compile-cache", "status", "--layout", "torch", "--cache-dir", str(cache), *flag,
                    env=cli_env)
        assert r.code == 0, r.err
        assert json.loads(r.out)["cache_dir"] == str(cache)


class _Exposition(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


LONG_STORE = "hf://buckets/a-rather-long-organisation-name/a-rather-long-bucket-name/llama-3.1-8b/prod"


@pytest.fixture
def metrics_url() -> Iterator[str]:
    """A /metrics endpoint serving a kvbucket exposition whose store name is longer than a terminal."""
    _Exposition.body = (
        "# TYPE kvbucket_store_objects_total counter\n"
        f'kvbucket_store_objects_total{{store="{LONG_STORE}",op="get",result="hit"}} 7\n'
        f'kvbucket_store_objects_total{{store="{LONG_STORE}",op="get",result="miss"}} 3\n'
        "# TYPE kvbucket_backend_operations_total counter\n"
        'kvbucket_backend_operations_total{tier="local_disk",op="get",result="hit"} 5\n'
    ).encode()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Exposition)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


def test_stats_format_json(metrics_url: str, cli_env: dict[str, str]) -> None:
    r = run_cli("stats", "--url", metrics_url, "--format", "json", env=cli_env)
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    rows = {(row["kind"], row["name"]): row for row in doc["rows"]}
    assert rows[("store", LONG_STORE)]["hits"] == 7 and rows[("store", LONG_STORE)]["hit_ratio"] == 0.7
    assert rows[("tier", "local_disk")]["hits"] == 5
    assert doc["url"] == metrics_url


# ---- 3. tables not cut when not on a terminal ----------------------------------------------------

@pytest.mark.parametrize("columns", ["40", "100"])
def test_stats_table_keeps_every_name_whole_in_a_pipe(metrics_url: str, cli_env: dict[str, str],
                                                       columns: str) -> None:
    r = run_cli("stats", "--url", metrics_url, env={**cli_env, "COLUMNS": columns})
    assert r.code == 0, r.err
    assert LONG_STORE in r.out, r.out
    assert "local_disk" in r.out and "…" not in r.out, r.out


def test_verify_line_keeps_a_long_url_whole_in_a_pipe(tmp_path: Path, cli_env: dict[str, str]) -> None:
    deep = tmp_path / ("a-directory-with-a-long-name-" * 3) / "kv"
    FileStore(deep).put_many([("x.bin", b"x")])
    r = run_cli("verify", str(deep), env={**cli_env, "COLUMNS": "60"})
    assert r.code == 0, r.err
    assert f"verified 1 objects in file://{deep}" in r.out.splitlines(), r.out


# ---- 4. rm --dry-run, rm by key ------------------------------------------------------------

@pytest.fixture
def keyed(tmp_path: Path) -> Path:
    store = FileStore(tmp_path / "s")
    store.put_many([(key_to_name(KEY, "kv"), b"k" * 64), ("plain.bin", b"p" * 3)])
    return tmp_path / "s"


def test_rm_dry_run_lists_and_removes_nothing(keyed: Path, cli_env: dict[str, str]) -> None:
    r = run_cli("rm", str(keyed), "--prefix", "", "--dry-run", env=cli_env)
    assert r.code == 0, r.err
    assert r.out.splitlines() == [f"would remove {key_to_name(KEY, 'kv')} (64 bytes)",
                                  "would remove plain.bin (3 bytes)", "(dry run) would remove 2"]
    r = run_cli("rm", str(keyed), "plain.bin", "gone.bin", "--dry-run", "--format", "json", env=cli_env)
    assert json.loads(r.out) == {"dry_run": True, "removed": [{"name": "plain.bin", "size": 3}],
                                 "not_found": ["gone.bin"], "failed": [], "bytes": 3}
    assert sorted(i.name for i in FileStore(keyed).list("")) == sorted([key_to_name(KEY, "kv"), "plain.bin"])


def test_rm_takes_the_key_as_ls_keys_prints_it(keyed: Path, cli_env: dict[str, str]) -> None:
    r = run_cli("ls", str(keyed), "--keys", env=cli_env)
    shown = [ln.split(maxsplit=1)[1] for ln in r.out.splitlines()]
    assert f"kv/{KEY.to_string()}" in shown  # kv/meta-llama/Llama-3.1-8B@2@1@...: a key holding a '/'
    r = run_cli("rm", str(keyed), f"kv/{KEY.to_string()}", env=cli_env)
    assert (r.code, r.out.strip()) == (0, "removed 1"), r.out + r.err
    assert [i.name for i in FileStore(keyed).list("")] == ["plain.bin"]


# ---- 5. -h and -V ------------------------------------------------------------------------------

def test_short_help_and_version(cli_env: dict[str, str]) -> None:
    r = run_cli("-V", env=cli_env)
    assert (r.code, r.out.strip()) == (0, f"kvbucket {kvbucket.__version__}")
    for args in ([], ["ls"], ["compile-cache"], ["compile-cache", "status"], ["emulator", "serve"]):
        r = run_cli(*args, "-h", env=cli_env)
        assert r.code == 0, (args, r.err)
        assert r.out.startswith(f"Usage: {' '.join(['kvbucket', *args])} "), r.out[:200]
        assert "-h, --help" in r.out


# ---- 6. progress in a log ---------------------------------------------------------------------

def test_long_listings_print_progress_lines_when_not_on_a_terminal(
        filled_bucket: str, hub_bucket: Any, hub_env: dict[str, str], tmp_path: Path) -> None:
    """Each listing request takes 0.5 s (the emulator's latency rule); a line is due every 0.1 s:
    five intervals per request, so a correct command writes lines and one that writes none fails."""
    env = {**hub_env, "KVBUCKET_PROGRESS_INTERVAL": "0.1"}
    hub_bucket.hub.faults.add("tree", latency_s=0.5)
    for cmd in ("du", "ls"):
        r = run_cli(cmd, filled_bucket, env=env, cwd=tmp_path)
        assert r.code == 0, r.err
        lines = r.err_lines
        assert lines and all(ln.startswith(f"listing hf://buckets/{filled_bucket}: ") for ln in lines), r.err
        assert lines[-1].endswith("(done)") and "3 objects" in lines[-1], lines


def test_compile_cache_sync_and_fetch_print_progress_lines_when_not_on_a_terminal(
        hub_bucket: Any, hub_env: dict[str, str], tmp_path: Path) -> None:
    """Each commit (sync) and each Xet fetch (fetch) takes 0.5 s; a line is due every 0.1 s (five
    intervals per request: lines are due; a command that writes none fails)."""
    from kvbucket.testing.neuron_standin import DEFAULT_VERSION, StandInCompiler

    env = {**hub_env, "KVBUCKET_PROGRESS_INTERVAL": "0.1"}
    target = f"{hub_bucket.bucket_id}/neuron"  # a bucket id, as everywhere
    a, b = StandInCompiler(tmp_path / "a", DEFAULT_VERSION), StandInCompiler(tmp_path / "b", DEFAULT_VERSION)
    a.compile("g1")
    a.compile("g2")
    hub_bucket.hub.faults.add("batch", latency_s=0.5)
    r = run_cli("compile-cache", "sync", "--target", target, "--cache-dir", str(a.cache_dir), env=env,
                cwd=tmp_path)
    assert r.code == 0, r.err
    assert [ln for ln in r.err_lines if ln.startswith("sync: ") and " of " in ln], r.err
    hub_bucket.hub.faults.reset()
    hub_bucket.hub.faults.add("fetch", latency_s=0.5)
    r = run_cli("compile-cache", "fetch", "--target", target, "--cache-dir", str(b.cache_dir),
                "--compiler-version", DEFAULT_VERSION, env=env, cwd=tmp_path)
    assert r.code == 0, r.err
    assert [ln for ln in r.err_lines if ln.startswith(("fetch: ", "fetch (packs): ")) and " of " in ln], r.err
    b.compile("g1")
    b.compile("g2")
    assert b.compilations == 0  # fetched, not recompiled


def test_synthetic_demo_prints_progress_lines_when_not_on_a_terminal(
        hub_bucket: Any, hub_env: dict[str, str], tmp_path: Path) -> None:
    """The remote tier's commits take 0.5 s each; a line is due every 0.1 s (the bars only end up
    in a log)."""
    env = {**hub_env, "KVBUCKET_PROGRESS_INTERVAL": "0.1"}
    hub_bucket.hub.faults.add("batch", latency_s=0.5)
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--target", f"{hub_bucket.bucket_id}/demo", env=env,
                cwd=tmp_path, timeout=300)
    assert r.code == 0, r.out + r.err
    assert "all bytes verified" in r.out
    stored = [ln for ln in r.err_lines if ln.startswith("store (write-through, all tiers): ")]
    assert stored and all(" of 2 chunks" in ln for ln in stored), r.err
