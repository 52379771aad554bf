"""Unit tests of the emulator's pure parts: Xet formats, auth, fault rules, the CLI entry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import lz4.frame
import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from hypothesis import given
from hypothesis import strategies as st

from kvbucket.errors import ConfigError
from kvbucket.testing import FaultControl, HubEmulator
from kvbucket.testing.hub_emulator.auth import Auth, TokenSpec, parse_org
from kvbucket.testing.hub_emulator.faults import FaultPlan, FaultRule
from kvbucket.testing.hub_emulator.xet import (
    XetFormatError,
    _ungroup4,
    decode_chunk,
    hash_to_hex,
    hex_to_hash,
    merkle_root,
    verify_xorb,
)


@given(st.binary(min_size=32, max_size=32))
def test_hash_string_form_round_trips(h: bytes) -> None:
    s = hash_to_hex(h)
    assert len(s) == 64 and hex_to_hash(s) == h
    # each 8-byte group is printed as a little-endian u64
    assert s[:16] == f"{int.from_bytes(h[:8], 'little'):016x}"


@pytest.mark.parametrize("bad", ["", "ab", "zz" * 32, "a" * 65])
def test_bad_hash_strings_are_refused(bad: str) -> None:
    with pytest.raises(XetFormatError):
        hex_to_hash(bad)


@given(st.binary(max_size=300))
def test_byte_grouping_inverse(data: bytes) -> None:
    grouped = b"".join(data[k::4] for k in range(4))
    assert _ungroup4(grouped) == data
    if data:
        assert decode_chunk(2, lz4.frame.compress(grouped), len(data)) == data


def test_decode_chunk_checks_sizes_and_schemes() -> None:
    with pytest.raises(XetFormatError, match="header says"):
        decode_chunk(1, lz4.frame.compress(b"abc"), 4)
    with pytest.raises(XetFormatError, match="scheme"):
        decode_chunk(7, b"abc", 3)
    with pytest.raises(XetFormatError, match="LZ4"):
        decode_chunk(1, b"not lz4", 7)


def test_merkle_root_of_one_node_is_that_node_and_order_matters() -> None:
    a, b, c = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
    assert merkle_root([(a, 5)]) == a
    assert merkle_root([(a, 1), (b, 2), (c, 3)]) != merkle_root([(b, 2), (a, 1), (c, 3)])
    assert merkle_root([]) == bytes(32)


def test_verify_xorb_refuses_empty_and_trailing_garbage() -> None:
    with pytest.raises(XetFormatError, match="at least one chunk"):
        verify_xorb(b"", "0" * 64)
    chunk = bytes([0]) + (3).to_bytes(3, "little") + bytes([0]) + (3).to_bytes(3, "little") + b"abc"
    with pytest.raises(XetFormatError, match="truncated"):
        verify_xorb(chunk + b"\x00\x01", "0" * 64)


def test_token_spec_parsing_and_no_secret_in_repr() -> None:
    spec = TokenSpec.parse("alice=s3cr3t:with:colons:write")
    assert (spec.name, spec.secret.get_secret_value(), spec.scope) == ("alice", "s3cr3t:with:colons", "write")
    assert "s3cr3t" not in repr(spec)
    for bad in ["alice", "alice=secret", "alice=secret:admin", "=secret:read", "a/b=s:read"]:
        with pytest.raises(ConfigError):
            TokenSpec.parse(bad)


def test_xet_tokens_are_signed_scoped_and_expire() -> None:
    auth = Auth([], xet_ttl_s=1)
    token, exp = auth.issue_xet_token("ns/b", "read")
    assert auth.check_xet_token(f"Bearer {token}") == ("ns/b", "read")
    assert exp <= time.time() + 1
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert auth.check_xet_token(f"Bearer {forged}") is None
    assert Auth([]).check_xet_token(f"Bearer {token}") is None  # another server's key
    expired_auth = Auth([], xet_ttl_s=-10, signing_key=auth.signing_key)
    old, _ = expired_auth.issue_xet_token("ns/b", "write")
    assert auth.check_xet_token(f"Bearer {old}") is None


def test_callers_by_token_with_users_and_orgs() -> None:
    tokens = [TokenSpec.parse(t) for t in ("w=ww-secret:write", "w=wr-secret:read", "r=rr-secret:fine-read")]
    auth = Auth(tokens, orgs={"acme": ["w", "bob"]})
    writer = auth.caller("Bearer ww-secret")
    assert writer is not None and writer.can_write and writer.orgs == ("acme",)
    assert writer.member_of("w") and writer.member_of("acme") and not writer.member_of("r")
    assert writer.can_read("r", private=False) and not writer.can_read("r", private=True)
    w_read = auth.caller("Bearer wr-secret")
    assert w_read is not None and w_read.can_read("acme", private=True) and not w_read.can_write
    fine = auth.caller("Bearer rr-secret")
    assert fine is not None and fine.scope == "fine-read" and not fine.can_write and fine.orgs == ()
    assert auth.caller("Bearer nope") is None
    anon = auth.caller(None)
    assert anon is not None and not anon.authenticated and not anon.can_read("w", private=True)
    assert anon.can_read("w", private=False) and not anon.member_of("w")
    assert auth.namespaces() == {"w", "r", "acme", "bob"}
    open_caller = Auth([]).caller(None)
    assert open_caller is not None and open_caller.can_write and open_caller.member_of("anyone")


def test_token_and_org_specs_follow_the_hub_name_rules() -> None:
    assert TokenSpec.parse("__x__=s:write").name == "__x__"
    assert parse_org("acme=alice, bob") == ("acme", ["alice", "bob"])
    for bad in ("a--b=s:write", "-a=s:write", "a=s:admin", "a.git=s:read", "nosecret"):
        with pytest.raises(ConfigError):
            TokenSpec.parse(bad)
    for bad in ("acme", "ac..me=alice", "acme=-alice"):
        with pytest.raises(ConfigError):
            parse_org(bad)
    with pytest.raises(ConfigError, match="both a user and an organisation"):
        Auth([TokenSpec.parse("acme=s:write")], orgs={"acme": ["bob"]})
    with pytest.raises(ConfigError, match="same secret"):
        Auth([TokenSpec.parse("a=s:write"), TokenSpec.parse("b=s:read")])


def test_fault_plan_nth_and_times() -> None:
    plan = FaultPlan()
    plan.add(FaultRule("batch", status=500, nth=2))
    plan.add(FaultRule("*", latency_s=0.5, times=1))
    first, second, third = plan.check("batch"), plan.check("batch"), plan.check("batch")
    assert first is not None and first.latency_s == 0.5 and first.status is None
    assert second is not None and second.status == 500
    assert third is None
    plan.reset()
    assert plan.check("batch") is None


def test_emulator_with_tokens_open_server_and_repr(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "d", tokens={"u": ("very-secret-token", "write")}) as emu:
        assert "very-secret-token" not in repr(emu)
        assert HfApi(endpoint=emu.endpoint, token="very-secret-token").whoami()["name"] == "u"
    with HubEmulator() as open_emu:
        api = HfApi(endpoint=open_emu.endpoint, token=False)
        assert api.create_bucket("open-bucket").bucket_id == "local/open-bucket"
        data_dir = open_emu.data_dir
        assert (data_dir / "index.sqlite3").exists()
        assert oct(data_dir.stat().st_mode & 0o777) == "0o700"
        assert oct((data_dir / "signing.key").stat().st_mode & 0o777) == "0o600"
        api.batch_bucket_files("local/open-bucket", add=[(b"user data", "p")])
        for f in [data_dir / "index.sqlite3", *data_dir.glob("xorbs/*/*")]:
            assert oct(f.stat().st_mode & 0o777) == "0o600", f
    assert not data_dir.exists()  # a temporary data dir is removed at exit


def test_subprocess_mode_reports_its_own_cpu(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "d", subprocess=True) as emu:
        assert emu.pid != os.getpid()
        stats = emu.stats()
        assert stats["pid"] == emu.pid and stats["process_cpu_s"] > 0
        pid = emu.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_list_buckets_paginates(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "d") as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        for i in range(105):
            api.create_bucket(f"local/b{i:03d}")
        assert [b.id for b in api.list_buckets("local")] == [f"local/b{i:03d}" for i in range(105)]
        assert [b.id for b in api.list_buckets("local", search="b10")] == [f"local/b10{i}" for i in range(5)]
        assert emu.stats()["routes"]["list_buckets"]["requests"] == 3


def test_cli_serve_prints_endpoint_and_never_the_secret(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    env["KVBUCKET_EMULATOR_TOKENS"] = "cli=cli-super-secret:write"
    env["KVBUCKET_EMULATOR_ADMIN_KEY"] = "cli-admin-key"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbucket",
            "emulator",
            "serve",
            "--data-dir",
            str(tmp_path / "d"),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("HF_ENDPOINT=http://127.0.0.1:")
        endpoint = line.split("=", 1)[1]
        with urllib.request.urlopen(f"{endpoint}/_emulator/health", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
        assert HfApi(endpoint=endpoint, token="cli-super-secret").whoami()["name"] == "cli"
        faults = FaultControl(endpoint, "cli-admin-key")
        faults.add("whoami", status=500, nth=1)
        with pytest.raises(HfHubHTTPError):
            HfApi(endpoint=endpoint, token="cli-super-secret").whoami()
        assert [r["fired"] for r in faults.rules()] == [1]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "cli-super-secret" not in out + err + line
    assert "cli (write)" in err


def test_no_token_in_logs_or_error_replies(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    secret, reader = "tok-write-0123456789", "tok-read-0123456789"
    with (
        caplog.at_level(logging.DEBUG),
        HubEmulator(tmp_path / "d", {"w": (secret, "write"), "r": (reader, "read")}) as emu,
    ):
        api = HfApi(endpoint=emu.endpoint, token=secret)
        api.create_bucket("w/logs", private=True)
        api.batch_bucket_files("w/logs", add=[(b"x" * 1000, "f")])
        replies = []
        for token in ("tok-wrong-0123456789", reader):
            with pytest.raises((HfHubHTTPError, ConnectionError)) as e:
                HfApi(endpoint=emu.endpoint, token=token).batch_bucket_files("w/logs", delete=["f"])
            replies.append(str(e.value))
            if isinstance(e.value, HfHubHTTPError):
                replies.append(e.value.response.text + str(dict(e.value.response.headers)))
        xet = api._build_hf_headers()  # a Xet token, then a bad xorb logged as refused
        req = urllib.request.Request(f"{emu.endpoint}/api/buckets/w/logs/xet-write-token", headers=xet)
        with urllib.request.urlopen(req) as r:
            xet_token = json.loads(r.read())["accessToken"]
        bad = urllib.request.Request(
            f"{emu.endpoint}/cas/v1/xorbs/default/{'ab' * 32}",
            data=b"\x00" * 16,
            headers={"Authorization": f"Bearer {xet_token}"},
        )
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(bad)
    assert "refused xorb" in caplog.text  # the refusal was logged...
    for s in (secret, reader, "tok-wrong-0123456789", xet_token):
        assert s not in caplog.text  # ...without any token
        assert all(s not in r for r in replies)


def test_xet_tokens_expire_and_the_client_keeps_working(tmp_path: Path) -> None:
    """Xet tokens live 2 s here: an old one is refused, the client fetches new ones by itself."""
    with HubEmulator(tmp_path / "d", xet_token_ttl_s=2) as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/ttl")
        data = os.urandom(100_000)
        api.batch_bucket_files("local/ttl", add=[(data, "a")])
        (info,) = api.get_bucket_paths_info("local/ttl", ["a"])
        with urllib.request.urlopen(f"{emu.endpoint}/api/buckets/local/ttl/xet-read-token") as r:
            old = json.loads(r.read())
        recon = urllib.request.Request(
            f"{old['casUrl']}/v2/reconstructions/{info.xet_hash}",
            headers={"Authorization": f"Bearer {old['accessToken']}"},
        )
        with urllib.request.urlopen(recon) as r:
            assert r.status == 200
        time.sleep(3.1)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(recon)
        assert e.value.code == 401
        before = emu.stats()["routes"]["xet_token"]["requests"]
        api.download_bucket_files("local/ttl", [("a", tmp_path / "a")])
        assert (tmp_path / "a").read_bytes() == data
        assert emu.stats()["routes"]["xet_token"]["requests"] > before


def test_fixture_isolates_xet_cache_and_hides_stored_tokens(hub_bucket) -> None:  # type: ignore[no-untyped-def]
    from huggingface_hub import constants
    from huggingface_hub.errors import BucketNotFoundError

    assert os.environ["HF_XET_CACHE"] == constants.HF_XET_CACHE
    assert "kvbucket-hfhome-" in os.environ["HF_XET_CACHE"]
    assert "HF_TOKEN" not in os.environ and not Path(constants.HF_TOKEN_PATH).exists()
    with pytest.raises(BucketNotFoundError):  # token=None: no stored token is found or sent
        HfApi(endpoint=hub_bucket.hub.endpoint).bucket_info(hub_bucket.bucket_id)


def test_zerocopy_wait_works_for_descriptors_above_1024():
    """select() refuses fds >= 1024; an emulator inside a process with many open files gets them."""
    import resource
    import socket

    from kvbucket.testing.hub_emulator.zerocopy import _wait_readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if hard != resource.RLIM_INFINITY and hard <= high:
        high = hard - 1
    assert high >= 1024, "the hard open-file limit is too low to reach fd 1024 on this machine"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, high + 1), hard))
    a, b = socket.socketpair()
    try:
        fd = os.dup2(a.fileno(), high)
        try:
            assert _wait_readable(fd, 0.05) is False
            b.send(b"x")
            assert _wait_readable(fd, 1.0) is True
        finally:
            os.close(fd)
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
