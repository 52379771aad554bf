"""The emulator's TLS mode with the unmodified huggingface_hub and hf_xet clients.

The Hub and its Xet CAS are served only over HTTPS; the served-bytes cells over TLS
(tests/integrity) and anyone's test of the production transport rely on this mode working end
to end: Hub routes, Xet uploads and downloads (the CAS URLs it hands out are https too), the
admin calls, in a thread and in a subprocess, with the CA trusted only where a test asks.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvbucket.testing.hub_emulator import HubEmulator, cas_routes, zerocopy
from kvbucket.testing.hub_fixtures import HubBucket, assert_all_tls, trust_ca
from kvbucket.testing.tls import make_test_certificates


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Record what ``module.name`` returns (the emulator runs in this process's thread)."""
    real, seen = getattr(module, name), []

    def wrapped(*args: Any) -> Any:
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(module, name, wrapped)
    return seen


def test_huggingface_hub_uploads_and_downloads_over_tls(hub_tls_bucket: HubBucket, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Upload (a 3 MB file: above the zero-copy size, so the splice path is asked and declines
    under TLS), list, download with hf_xet, byte for byte; every request over TLS, the Xet
    token's CAS URL and the reconstruction's fetch URLs https, sendfile never used on a TLS socket."""
    hub, bucket = hub_tls_bucket.hub, hub_tls_bucket.bucket_id
    assert hub.endpoint.startswith("https://127.0.0.1:")
    spliced = _spy(monkeypatch, zerocopy, "socket_fd")
    sent = _spy(monkeypatch, cas_routes, "_sendfile_now")
    big, small = os.urandom(3 << 20), b"hello over tls"
    (tmp_path / "big.bin").write_bytes(big)
    before = hub.stats()["routes"]
    api = hub_tls_bucket.api
    api.batch_bucket_files(bucket, add=[(str(tmp_path / "big.bin"), "d/big.bin"), (small, "d/small.txt")])
    listed = sorted(f.path for f in api.list_bucket_tree(bucket) if f.type == "file")
    assert listed == ["d/big.bin", "d/small.txt"]
    out = tmp_path / "out"
    api.download_bucket_files(bucket, [("d/big.bin", str(out / "big.bin")),
                                       ("d/small.txt", str(out / "s.txt"))])
    assert (out / "big.bin").read_bytes() == big and (out / "s.txt").read_bytes() == small
    assert_all_tls(before, hub.stats()["routes"], "xorb_upload", "shard_upload", "reconstruction", "fetch")
    assert spliced and set(spliced) == {None}  # asked for the big xorb, declined: the body is TLS records
    assert sent and set(sent) == {0}  # fetches went through the TLS transport, not os.sendfile

    def call(url: str, token: str, body: Any = None) -> Any:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"},
                                     data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=30) as r:  # trusts the CA: SSL_CERT_FILE (trust_ca)
            return json.loads(r.read())

    xet = call(f"{hub.endpoint}/api/buckets/{bucket}/xet-read-token", hub.write_token)
    assert xet["casUrl"].startswith(hub.endpoint)  # https: hf_xet and kvbucket fetch over TLS
    [info] = call(f"{hub.endpoint}/api/buckets/{bucket}/paths-info", hub.write_token,
                  {"paths": ["d/big.bin"]})
    recon = call(f"{xet['casUrl']}/v1/reconstructions/{info['xetHash']}", xet["accessToken"])
    urls = [f["url"] for infos in recon["fetch_info"].values() for f in infos]
    assert urls and all(u.startswith(f"{hub.endpoint}/") for u in urls), urls


def test_a_tls_emulator_in_a_subprocess_and_its_admin_calls(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The subprocess mode serves TLS too; its fault control, stats, request log and collection
    trust the CA per call (no environment); a client not told the CA is refused, and
    ``trust_ca`` gives the trust to huggingface_hub for its block only."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet"))  # hf_xet's shard cache for this server only
    certs = make_test_certificates(tmp_path)
    with HubEmulator(tmp_path / "data", tokens={"me": ("secret-me-1", "write")}, tls=certs,
                     subprocess=True) as emu:
        assert emu.endpoint.startswith("https://") and emu.ca == certs.ca and emu.pid != os.getpid()
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(f"{emu.endpoint}/_emulator/health", timeout=30)
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
        emu.faults.add("batch", status=503, times=1)
        assert [r["route"] for r in emu.faults.rules()] == ["batch"]
        emu.faults.reset()
        assert emu.faults.rules() == []
        with trust_ca(certs.ca):
            from huggingface_hub import HfApi

            api = HfApi(endpoint=emu.endpoint, token="secret-me-1")
            api.create_bucket("me/b", private=True)
            api.batch_bucket_files("me/b", add=[(b"x" * 1000, "k")])
            api.download_bucket_files("me/b", [("k", str(tmp_path / "k"))])
        assert "SSL_CERT_FILE" not in os.environ
        assert (tmp_path / "k").read_bytes() == b"x" * 1000
        routes = emu.stats()["routes"]
        assert routes["fetch"]["tls"] == routes["fetch"]["requests"] == 1
        assert {e["route"] for e in emu.requests(clear=True)} >= {"create_bucket", "batch", "fetch"}
        assert emu.collect_xorbs(grace_s=0)["xorbs"] == 0  # the one xorb is referenced
