"""The emulator answers like the Hub, as the unmodified huggingface_hub 2.4.0 client sees it.

One test per behaviour of issue 14 (tree recursion default, bucket ids without namespace,
privacy between users and organisations, anonymous 401, ``{"private": true}``, RepoNotFound on
model/dataset routes, the Hub's namespace rules), then users, organisations and tokens
(read-only and fine-grained read-only tokens on writes, unknown tokens, ``whoami`` and
``hf auth whoami``), and the admin fence on the stats and fault routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx2
import pytest
from huggingface_hub import HfApi, HfFileSystem
from huggingface_hub.errors import BucketNotFoundError, HfHubHTTPError, RepositoryNotFoundError

from kvbucket.testing import HubEmulator
from kvbucket.testing.hub_fixtures import MEMBER_USER, ORG, OTHER_USER, WRITE_USER, HubBucket, RunningHub

HF_CLI = str(Path(sys.executable).parent / "hf")  # the console script of the unmodified client


def _hf_cli_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """The environment of an ``hf`` subprocess on this emulator (no update check: no network)."""
    return {
        **os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "home"),
        "HF_XET_CACHE": str(tmp_path / "xet"), "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1", "NO_COLOR": "1",
    }  # fmt: skip


_HF_DRIVER = r"""
import json, sys
from huggingface_hub.cli.hf import app  # the click app behind the `hf` console script
for line in sys.stdin:
    try:
        app.main(json.loads(line), prog_name="hf", standalone_mode=False, windows_expand_args=False)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", flush=True)
        code = 1
    print(f"\n@@@ rc={code}", flush=True)
"""


class _HfCli:
    """Runs many ``hf`` commands in one process (importing the CLI once costs ~1.5 s here)."""

    def __init__(self, env: dict[str, str]) -> None:
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HF_DRIVER],
            env=env,
            text=True,
            stdin=pipe,
            stdout=pipe,
            stderr=subprocess.STDOUT,
        )

    def run(self, *args: str) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.startswith("@@@ rc="):
                return int(line.strip()[7:]), "".join(lines)
            lines.append(line)
        raise AssertionError(f"the hf driver ended during {args}: {''.join(lines)}")

    def __enter__(self) -> _HfCli:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _status(e: pytest.ExceptionInfo[HfHubHTTPError]) -> int:
    return int(e.value.response.status_code)


def _new_id(ns: str) -> str:
    return f"{ns}/p-{uuid.uuid4().hex[:12]}"


def _http(method: str, url: str, token: str | None = None, body: Any = None) -> tuple[int, Any, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx2.request(method, url, headers=headers, json=body, timeout=30)
    try:
        data = r.json()
    except ValueError:
        data = None
    return r.status_code, dict(r.headers), data


# --- 1. tree listings are recursive unless told recursive=false -------------------------------
def test_tree_is_recursive_by_default_and_one_level_with_recursive_false(hub_bucket: HubBucket) -> None:
    api, bid = hub_bucket.api, hub_bucket.bucket_id
    paths = ["top.txt", "d/x.txt", "d/e/y.txt"]
    api.batch_bucket_files(bid, add=[(p.encode(), p) for p in paths])
    # recursive=None: the 2.4.0 client sends no parameter at all
    assert sorted(e.path for e in api.list_bucket_tree(bid)) == sorted(paths)
    assert sorted(e.path for e in api.list_bucket_tree(bid, prefix="d")) == ["d/e/y.txt", "d/x.txt"]
    one_level = {(e.type, e.path) for e in api.list_bucket_tree(bid, recursive=False)}
    assert one_level == {("file", "top.txt"), ("directory", "d")}
    # what relied on the default: copying a prefix copies every file below it
    api.copy_files(f"hf://buckets/{bid}/d", f"hf://buckets/{bid}/copy/")
    assert sorted(e.path for e in api.list_bucket_tree(bid, prefix="copy/")) == ["copy/e/y.txt", "copy/x.txt"]


# --- 2. a bucket id without a namespace is a 404 ----------------------------------------------
def test_bucket_id_without_namespace_is_404_on_get_and_delete(hub_emulator: RunningHub) -> None:
    api = hub_emulator.api()
    with pytest.raises(BucketNotFoundError) as e:
        api.bucket_info("no-namespace-bucket")
    assert _status(e) == 404
    with pytest.raises(HfHubHTTPError) as e2:
        api.delete_bucket("no-namespace-bucket")
    assert _status(e2) == 404
    api.delete_bucket("no-namespace-bucket", missing_ok=True)  # the client's own 404 handling


# --- 3. private buckets: owner and organisation members only ----------------------------------
def test_private_bucket_is_invisible_to_other_users_and_visible_to_its_org(hub_emulator: RunningHub) -> None:
    hub = hub_emulator
    owner, other, member = hub.api(), hub.api(hub.token(OTHER_USER)), hub.api(hub.token(MEMBER_USER))
    personal, org_bucket, public = _new_id(WRITE_USER), _new_id(ORG), _new_id(WRITE_USER)
    owner.create_bucket(personal, private=True)
    owner.create_bucket(org_bucket, private=True)
    owner.create_bucket(public)
    owner.batch_bucket_files(personal, add=[(b"secret prompt", "k")])
    owner.batch_bucket_files(org_bucket, add=[(b"team data", "k")])
    for api in (other, member):  # kvmember shares kvorg with kvtest, not kvtest's own namespace
        with pytest.raises(BucketNotFoundError) as e:
            api.bucket_info(personal)
        assert _status(e) == 404
        with pytest.raises(BucketNotFoundError):
            list(api.list_bucket_tree(personal))
        with pytest.raises(BucketNotFoundError):
            list(api.get_bucket_paths_info(personal, ["k"]))
        with pytest.raises((BucketNotFoundError, HfHubHTTPError)) as e3:
            api.get_bucket_file_metadata(personal, "k")
        assert e3.value.response.status_code == 404  # type: ignore[union-attr]
    listed = {b.id for b in other.list_buckets(namespace=WRITE_USER)}
    assert public in listed and personal not in listed
    assert personal in {b.id for b in owner.list_buckets(namespace=WRITE_USER)}
    # the organisation's private bucket: its members read and write it, others get 404
    assert member.bucket_info(org_bucket).private is True
    assert [f.path for f in member.list_bucket_tree(org_bucket)] == ["k"]
    member.batch_bucket_files(org_bucket, add=[(b"from member", "m")])
    assert org_bucket in {b.id for b in member.list_buckets(namespace=ORG)}
    with pytest.raises(BucketNotFoundError):
        other.bucket_info(org_bucket)
    assert org_bucket not in {b.id for b in other.list_buckets(namespace=ORG)}
    # a public bucket of someone else: readable, not writable (403), not deletable
    assert other.bucket_info(public).id == public
    with pytest.raises(HfHubHTTPError) as e4:
        other.batch_bucket_files(public, delete=["x"])
    assert _status(e4) == 403
    with pytest.raises(HfHubHTTPError) as e5:
        other.delete_bucket(public)
    assert _status(e5) == 403
    with pytest.raises(HfHubHTTPError) as e6:
        other.create_bucket(_new_id(WRITE_USER))  # not its namespace
    assert _status(e6) == 403
    with pytest.raises(HfHubHTTPError) as e7:
        other.move_bucket(personal, _new_id(OTHER_USER))
    assert _status(e7) == 404
    # the private bucket cannot be reached through a copy either
    mine = _new_id(OTHER_USER)
    other.create_bucket(mine, private=True)
    with pytest.raises(BucketNotFoundError):
        other.copy_files(f"hf://buckets/{personal}/k", f"hf://buckets/{mine}/stolen")


# --- 4. anonymous callers get 401 on private bucket routes ------------------------------------
def test_anonymous_caller_gets_401_on_private_bucket_routes(hub_bucket: HubBucket) -> None:
    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    hub_bucket.api.batch_bucket_files(bid, add=[(b"x", "k")])
    anon = hub.api(token=False)
    calls = [
        lambda: anon.bucket_info(bid),
        lambda: list(anon.list_bucket_tree(bid)),
        lambda: list(anon.get_bucket_paths_info(bid, ["k"])),
    ]
    for call in calls:
        with pytest.raises(BucketNotFoundError) as e:  # 401 + RepoNotFound: the client's not-found
            call()
        assert _status(e) == 401
    status, headers, _ = _http("GET", f"{hub.endpoint}/buckets/{bid}/resolve/k")
    assert status == 401 and headers["x-error-code"] == "RepoNotFound"
    status, _, _ = _http("GET", f"{hub.endpoint}/api/buckets/{bid}/xet-read-token")
    assert status == 401
    with pytest.raises(HfHubHTTPError) as e2:
        anon.create_bucket(_new_id(WRITE_USER))
    assert _status(e2) == 401


# --- 5. {"private": true} at create ------------------------------------------------------------
def test_create_honours_private_true_and_visibility(hub_emulator: RunningHub) -> None:
    hub = hub_emulator
    base = f"{hub.endpoint}/api/buckets"
    a, b, c = _new_id(WRITE_USER), _new_id(WRITE_USER), _new_id(WRITE_USER)
    assert _http("POST", f"{base}/{a}", hub.write_token, {"private": True})[0] == 200
    assert _http("POST", f"{base}/{b}", hub.write_token, {"private": False})[0] == 200
    status, _, body = _http("POST", f"{base}/{c}", hub.write_token, {"private": True, "visibility": "public"})
    assert status == 400 and "contradicts" in body["error"]
    api = hub.api()
    assert api.bucket_info(a).private is True and api.bucket_info(b).private is False
    d, e = _new_id(WRITE_USER), _new_id(WRITE_USER)
    api.create_bucket(d, private=True)  # the 2.4.0 client sends {"visibility": "private"}
    api.create_bucket(e)  # nothing: public, the Hub's default
    assert api.bucket_info(d).private is True and api.bucket_info(e).private is False
    with pytest.raises(BucketNotFoundError):
        hub.api(token=False).bucket_info(a)


# --- 6. model/dataset repo routes answer RepoNotFound ------------------------------------------
def test_repo_routes_are_repo_not_found_hffilesystem_file_not_found(hub_emulator: RunningHub) -> None:
    hub = hub_emulator
    api = hub.api()
    with pytest.raises(RepositoryNotFoundError) as e:
        api.repo_info("missing/repo")
    assert _status(e) == 404
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("missing/data", repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError) as e2:
        hub.api(token=False).model_info("missing/repo")
    assert _status(e2) == 401  # anonymous, as on the Hub
    fs = HfFileSystem(endpoint=hub.endpoint, token=hub.write_token, skip_instance_cache=True)
    with pytest.raises(FileNotFoundError):
        fs.ls("missing/repo")
    with pytest.raises(FileNotFoundError):
        fs.ls("datasets/missing/data")
    with pytest.raises(FileNotFoundError):
        fs.cat("hf://missing/repo/config.json")
    url = f"{hub.endpoint}/missing/repo/resolve/main/config.json"
    status, headers, _ = _http("GET", url, hub.write_token)
    assert status == 404 and headers["x-error-code"] == "RepoNotFound"


# --- 7. the Hub's namespace and name rules ------------------------------------------------------
def test_hub_valid_names_are_accepted_and_invalid_ones_refused(tmp_path: Path) -> None:
    user, org = "_kv__user_", "team_.x_"
    with HubEmulator(tmp_path / "d", tokens={user: ("names-secret", "write")}, orgs={org: [user]}) as emu:
        api = HfApi(endpoint=emu.endpoint, token="names-secret")
        for bid in (f"{user}/_b__x_", f"{org}/a.b_c-d", f"{user}/9"):
            api.create_bucket(bid, private=True)
            assert api.bucket_info(bid).id == bid
        base = f"{emu.endpoint}/api/buckets"
        for name in ("-x", "x.", "a--b", "a..b", "x.git", "a" * 97):
            bad = f"{user}/{name}"
            status, _, body = _http("POST", f"{base}/{bad}", "names-secret", {})
            assert status == 400, bad
            assert "invalid bucket name" in body["error"]


# --- users, organisations and tokens ----------------------------------------------------------
@pytest.mark.parametrize("scope", ["read", "fine-read"])
def test_read_only_tokens_get_403_on_every_write(hub_bucket: HubBucket, scope: str) -> None:
    hub, bid = hub_bucket.hub, hub_bucket.bucket_id
    hub_bucket.api.batch_bucket_files(bid, add=[(b"data", "r.txt")])
    reader = hub.api(hub.token(WRITE_USER, scope))
    assert [f.path for f in reader.list_bucket_tree(bid)] == ["r.txt"]  # it reads its own private bucket
    writes = [
        lambda: reader.batch_bucket_files(bid, delete=["r.txt"]),
        lambda: reader.create_bucket(_new_id(WRITE_USER)),
        lambda: reader.update_bucket_settings(bid, private=False),
        lambda: reader.delete_bucket(bid),
        lambda: reader.move_bucket(bid, _new_id(WRITE_USER)),
    ]
    for call in writes:
        with pytest.raises(HfHubHTTPError) as e:
            call()
        assert _status(e) == 403
    url = f"{hub.endpoint}/api/buckets/{bid}/xet-write-token"
    status, _, _ = _http("GET", url, hub.token(WRITE_USER, scope))
    assert status == 403
    assert [f.path for f in reader.list_bucket_tree(bid)] == ["r.txt"]


def test_unknown_token_gets_401_even_on_public_buckets(hub_emulator: RunningHub) -> None:
    public = _new_id(WRITE_USER)
    hub_emulator.api().create_bucket(public)
    stranger = hub_emulator.api("hf_not_a_real_token")
    with pytest.raises(HfHubHTTPError) as e:
        stranger.bucket_info(public)
    assert _status(e) == 401
    with pytest.raises(HfHubHTTPError, match="Invalid user token") as e2:
        stranger.whoami()
    assert _status(e2) == 401
    assert hub_emulator.api(token=False).bucket_info(public).id == public  # anonymous may read it


def test_whoami_has_the_hubs_shape(hub_emulator: RunningHub) -> None:
    hub = hub_emulator
    me = hub.api().whoami()
    assert me["type"] == "user" and me["name"] == WRITE_USER
    assert [o["name"] for o in me["orgs"]] == [ORG] and me["orgs"][0]["type"] == "org"
    assert me["auth"]["type"] == "access_token" and me["auth"]["accessToken"]["role"] == "write"
    assert hub.api(hub.read_token).whoami()["auth"]["accessToken"]["role"] == "read"
    fine = hub.api(hub.token(OTHER_USER, "fine-read")).whoami()
    assert fine["name"] == OTHER_USER and fine["orgs"] == []
    assert fine["auth"]["accessToken"]["role"] == "fineGrained"
    scoped = fine["auth"]["accessToken"]["fineGrained"]["scoped"]
    assert scoped == [{"entity": {"_id": scoped[0]["entity"]["_id"], "type": "user", "name": OTHER_USER},
                       "permissions": ["repo.content.read"]}]  # fmt: skip
    with pytest.raises(ValueError):
        hub.api(token=False).whoami()  # the client refuses locally; the server answers 401 (below)
    assert _http("GET", f"{hub.endpoint}/api/whoami-v2")[0] == 401


def test_hf_cli_whoami_and_buckets_ls_see_users_and_orgs(hub_emulator: RunningHub, tmp_path: Path) -> None:
    hub = hub_emulator
    bid = _new_id(ORG)
    hub.api().create_bucket(bid, private=True)
    hub.api().batch_bucket_files(bid, add=[(b"x", "a/b/c.txt")])
    env = _hf_cli_env(hub.endpoint, tmp_path)

    who = subprocess.run([HF_CLI, "auth", "whoami"], env={**env, "HF_TOKEN": hub.token(MEMBER_USER)},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert who.returncode == 0, who.stderr
    assert MEMBER_USER in who.stdout and ORG in who.stdout
    with _HfCli(env) as cli:
        rc, out = cli.run(
            "buckets", "ls", f"hf://buckets/{bid}", "-R", "--token", hub.token(MEMBER_USER, "read")
        )
        assert rc == 0 and "a/b/c.txt" in out, out
        rc, out = cli.run("buckets", "ls", f"hf://buckets/{bid}", "-R", "--token", hub.token(OTHER_USER))
        assert rc != 0 and "a/b/c.txt" not in out


# --- issue 15: the stats and fault routes need the admin key when tokens are configured --------
def test_stats_and_faults_need_the_admin_key_when_tokens_are_configured(tmp_path: Path) -> None:
    tokens = {"u": ("stats-secret", "write")}
    with HubEmulator(tmp_path / "d", tokens=tokens, admin_key="admin-key-123") as emu:
        for path in ("/_emulator/stats", "/_emulator/faults"):
            for token in (None, "stats-secret", "wrong"):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                req = urllib.request.Request(f"{emu.endpoint}{path}", headers=headers)
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=10)
                assert e.value.code == 403
            bad_key = urllib.request.Request(
                f"{emu.endpoint}{path}", headers={"X-Emulator-Admin": "admin-key"}
            )
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(bad_key, timeout=10)
        assert emu.stats()["routes"]["control"]["requests"] >= 8  # HubEmulator sends its key
        assert emu.faults.rules() == []
        with urllib.request.urlopen(f"{emu.endpoint}/_emulator/health", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
    with HubEmulator(tmp_path / "open") as open_emu:  # open mode: stats answer anyone
        with urllib.request.urlopen(f"{open_emu.endpoint}/_emulator/stats", timeout=10) as r:
            assert "routes" in json.loads(r.read())
        with pytest.raises(urllib.error.HTTPError) as e2:
            urllib.request.urlopen(f"{open_emu.endpoint}/_emulator/faults", timeout=10)
        assert e2.value.code == 403  # fault control always needs the key


def test_hf_buckets_cli_commands_against_the_emulator(hub_emulator: RunningHub, tmp_path: Path) -> None:
    """Every ``hf buckets`` command of the unmodified client, as a user runs it."""
    hub = hub_emulator
    bid = _new_id(WRITE_USER)
    local = tmp_path / "up"
    (local / "sub" / "deep").mkdir(parents=True)
    (local / "top.txt").write_text("top")
    (local / "sub" / "deep" / "x.txt").write_text("deep")
    env = {**_hf_cli_env(hub.endpoint, tmp_path), "HF_TOKEN": hub.write_token}
    with _HfCli(env) as cli:

        def hf(*args: str) -> str:
            rc, out = cli.run("buckets", *args)
            assert rc == 0, (args, out)
            return out

        _hf_buckets_session(hub, hf, bid, local, tmp_path)


def _hf_buckets_session(hub: RunningHub, hf: Any, bid: str, local: Path, tmp_path: Path) -> None:
    hf("create", bid, "--private")
    assert hub.api().bucket_info(bid).private is True
    hf("sync", str(local), f"hf://buckets/{bid}/data")
    hf("cp", str(local / "top.txt"), f"hf://buckets/{bid}/single.txt")
    listed = hf("ls", bid, "-R")
    assert "data/sub/deep/x.txt" in listed and "single.txt" in listed
    assert "data/sub/deep/x.txt" not in hf("ls", bid)  # one level without -R
    hf("cp", f"hf://buckets/{bid}/data/sub/deep/x.txt", str(tmp_path / "x.txt"))
    assert (tmp_path / "x.txt").read_text() == "deep"
    hf("rm", f"{bid}/data/sub", "--recursive", "-y")
    assert {f.path for f in hub.api().list_bucket_tree(bid)} == {"data/top.txt", "single.txt"}
    hf("settings", bid, "--public")
    assert hub.api(token=False).bucket_info(bid).private is False
    moved = _new_id(ORG)
    hf("move", bid, moved)
    assert "single.txt" in hf("ls", moved, "-R")
    assert '"id"' in hf("info", moved, "--json") or moved in hf("info", moved)
    hf("delete", moved, "-y")
    with pytest.raises(BucketNotFoundError):
        hub.api().bucket_info(moved)


def test_cli_serve_with_orgs_applies_them_and_fences_stats(tmp_path: Path) -> None:
    kvbucket = str(Path(sys.executable).parent / "kvbucket")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    env["KVBUCKET_EMULATOR_TOKENS"] = "alice=alice-cli-secret:write bob=bob-cli-secret:write"
    env["KVBUCKET_EMULATOR_ADMIN_KEY"] = "cli-admin-key"
    bad = subprocess.run([kvbucket, "emulator", "serve", "--data-dir", str(tmp_path / "x"), "--org", "acme"],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "ORG=USER,USER" in bad.stderr
    cmd = [kvbucket, "emulator", "serve", "--data-dir", str(tmp_path / "d"), "--org", "acme=alice"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip().split("=", 1)[1]
        alice, bob = (
            HfApi(endpoint=endpoint, token="alice-cli-secret"),
            HfApi(endpoint=endpoint, token="bob-cli-secret"),
        )
        assert [o["name"] for o in alice.whoami()["orgs"]] == ["acme"]
        alice.create_bucket("acme/team", private=True)
        with pytest.raises(BucketNotFoundError):
            bob.bucket_info("acme/team")
        with pytest.raises(HfHubHTTPError) as e:
            bob.create_bucket("acme/other")
        assert _status(e) == 403
        with pytest.raises(urllib.error.HTTPError) as e2:
            urllib.request.urlopen(f"{endpoint}/_emulator/stats", timeout=10)
        assert e2.value.code == 403
        req = urllib.request.Request(
            f"{endpoint}/_emulator/stats", headers={"X-Emulator-Admin": "cli-admin-key"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["routes"]["create_bucket"]["requests"] == 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "acme: alice" in err
    assert "alice-cli-secret" not in err and "bob-cli-secret" not in err


def test_serve_help_says_what_open_mode_allows() -> None:
    kvbucket = str(Path(sys.executable).parent / "kvbucket")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "COLUMNS": "200"}
    r = subprocess.run(
        [kvbucket, "emulator", "serve", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.replace("│", " ").split()).replace("- ", "-")  # undo wrapping
    assert "Without any token the server is OPEN" in text and "in any namespace" in text
    assert "--org" in text and "ORG=USER,USER" in text and "fine-read" in text
