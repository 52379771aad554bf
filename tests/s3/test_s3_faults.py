"""Failures on a real server: credentials, missing buckets, throttling/5xx storms, addressing styles."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from kvbucket.errors import AuthError, NotFoundError, StoreError, TransientStoreError
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store, store_from_remote_url
from kvbucket.testing.s3_server import DOMAIN, FaultProxy, S3Server
from kvbucket.testing.seed_configs import SEED_004_COREWEAVE, seed_config

ENGINE = SimpleNamespace(save_unfull_chunk=False, blocking_timeout_secs=10)


def open_store(server: S3Server, bucket: str, prefix: str = "", **overrides: object) -> S3Store:
    return S3Store(S3Config.parse(server.config(bucket, prefix, **overrides)))


def test_wrong_secret_is_a_clear_auth_error_without_the_secret(
    seaweedfs: S3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "definitely-not-the-secret"
    with open_store(seaweedfs, s3_bucket, aws_secret_access_key=secret) as store:
        for results in (store.put_many([("a", b"1")]), store.get_many(["a"]), store.head_many(["a"])):
            err = results[0].error
            assert isinstance(err, AuthError), results
            assert "aws_secret_access_key" in str(err) and secret not in str(err)
        (put,) = store.put_many([("a", b"1")])
        assert "SignatureDoesNotMatch" in str(put.error) and "secret access key is wrong" in str(put.error)
        assert secret not in repr(store) and secret not in repr(store.config)
    assert secret not in caplog.text


def test_unknown_access_key_is_an_auth_error(seaweedfs: S3Server, s3_bucket: str) -> None:
    with open_store(seaweedfs, s3_bucket, aws_access_key_id="AKIAUNKNOWN") as store:
        (r,) = store.put_many([("a", b"1")])
        assert isinstance(r.error, AuthError)


@pytest.mark.parametrize("server_fixture", ["seaweedfs", "moto_s3"])
def test_missing_bucket_is_a_clear_not_found(request: pytest.FixtureRequest, server_fixture: str) -> None:
    server: S3Server = request.getfixturevalue(server_fixture)
    # head_many waits for the bucket probe (a LIST) only within its lookup budget; moto answers
    # from this process, so on a busy machine the default 1 s can pass first and HEAD says "miss".
    with open_store(server, "no-such-bucket-kvb", s3_lookup_timeout_secs=10.0) as store:
        with pytest.raises(NotFoundError, match="bucket 'no-such-bucket-kvb' does not exist"):
            store.head_many(["a"])  # HEAD alone cannot tell a missing bucket from a missing key
        with pytest.raises(NotFoundError, match="does not exist"):
            list(store.list())


@pytest.mark.parametrize(
    ("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests")]
)
def test_throttling_and_5xx_are_retried(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, status: int, code: str
) -> None:
    with open_store(seaweedfs, s3_bucket, s3_endpoint_url=fault_proxy.url) as store:
        store.put("k", b"value")
        fault_proxy.fail(status, code, times=2)
        assert store.get("k") == b"value"
        fault_proxy.fail(status, code, times=2, methods={"PUT"})
        assert store.put_many([("k2", b"v2")])[0].ok
        fault_proxy.fail(status, code, times=2, methods={"HEAD"})
        assert store.head("k2") == 2
        assert fault_proxy.injected == 6


@pytest.mark.parametrize("direct", [True, False])
def test_a_storm_of_errors_is_many_per_item_retries_not_a_hang(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, direct: bool
) -> None:
    with open_store(
        seaweedfs, s3_bucket, s3_endpoint_url=fault_proxy.url, s3_max_retries=2, s3_direct_reads=direct
    ) as store:
        store.put_many([(f"k{i}", b"v") for i in range(4)])
        fault_proxy.fail(503, "SlowDown", times=1000, methods={"GET"}, path_contains="/k1")
        fault_proxy.fail(500, "InternalError", times=1000, methods={"GET"}, path_contains="/k3")
        start = time.monotonic()
        results = store.get_many([f"k{i}" for i in range(4)])
        assert time.monotonic() - start < 10
        assert [r.ok for r in results] == [True, False, True, False]
        assert isinstance(results[1].error, TransientStoreError) and "SlowDown" in str(results[1].error)
        assert isinstance(results[3].error, TransientStoreError) and "InternalError" in str(results[3].error)
        assert bytes(results[0].data) == b"v" and bytes(results[2].data) == b"v"
        # obstore's first try + 2 retries for each failing item, after one direct attempt if enabled
        assert fault_proxy.injected == 2 * (3 + direct)
        fault_proxy.clear()
        assert store.get("k1") == b"v"


def test_retry_timeout_bounds_a_stalled_server(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    with open_store(
        seaweedfs,
        s3_bucket,
        s3_endpoint_url=fault_proxy.url,
        s3_request_timeout_secs=0.5,
        s3_retry_timeout_secs=2,
    ) as store:
        store.put("k", b"v")
        fault_proxy.fail(200, "", times=100, methods={"GET"}, delay=1.5)
        start = time.monotonic()
        (r,) = store.get_many(["k"])
        assert time.monotonic() - start < 8
        assert isinstance(r.error, TransientStoreError)


def test_dropped_connections_are_retried(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    with open_store(seaweedfs, s3_bucket, s3_endpoint_url=fault_proxy.url) as store:
        store.put("k", b"value")
        fault_proxy.drop(times=2, methods={"GET"})
        assert store.get("k") == b"value"
        fault_proxy.drop(times=1, methods={"PUT"})
        assert store.put_many([("k3", b"x")])[0].ok and store.get("k3") == b"x"


def test_virtual_hosted_addressing(seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy) -> None:
    """<bucket>.s3.kvbucket.test never resolves: the proxy carries it to SeaweedFS (-s3.domainName)."""
    overrides = {
        "s3_endpoint_url": f"http://{DOMAIN}:{seaweedfs.port}",
        "s3_addressing_style": "virtual",
        "s3_proxy_url": fault_proxy.url,
    }
    with open_store(seaweedfs, s3_bucket, "virt", **overrides) as store:
        assert store.target.virtual_hosted
        store.put_many([("a", b"virtual"), ("m%2Fx@1", b"2")])
        assert store.get("a") == b"virtual"
        assert sorted(o.name for o in store.list()) == ["a", "m%2Fx@1"]
        assert fault_proxy.hosts and all(
            h == f"{s3_bucket}.{DOMAIN}:{seaweedfs.port}" for h in fault_proxy.hosts
        )
    body = seaweedfs.client().get_object(Bucket=s3_bucket, Key="virt/a")["Body"].read()
    assert body == b"virtual"  # path-style boto3 sees the same object


def test_seed_basic_example_against_the_local_server(seaweedfs: S3Server, s3_bucket: str) -> None:
    extra = {"s3_region": "us-east-1", "s3_num_io_threads": 64, "save_chunk_meta": False}
    local = {
        "s3_endpoint_url": seaweedfs.endpoint_url,
        "aws_access_key_id": seaweedfs.access_key,
        "aws_secret_access_key": seaweedfs.secret_key,
    }
    with store_from_remote_url(f"s3://{s3_bucket}", {**extra, **local}, ENGINE) as store:
        store.put("chunk", b"x" * 1000)
        assert store.head("chunk") == 1000


def test_seed_coreweave_example_runs_unchanged_but_for_proxy_and_keys(
    seaweedfs: S3Server, fault_proxy: FaultProxy
) -> None:
    """remote_url s3://test-127.cwlota.com (virtual-hosted, plain HTTP) reaches SeaweedFS via the proxy."""
    seaweedfs.create_bucket("test-127")
    extra = seed_config(
        SEED_004_COREWEAVE,
        aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key,
        s3_proxy_url=fault_proxy.url,
    )["extra_config"]
    try:
        with store_from_remote_url("s3://test-127.cwlota.com", extra, ENGINE) as store:
            store.put("k", b"coreweave")
            assert store.get("k") == b"coreweave"
        assert fault_proxy.hosts[-1] == "test-127.cwlota.com"
    finally:
        seaweedfs.delete_bucket("test-127")


def test_default_chain_reads_aws_configure_profiles(
    seaweedfs: S3Server, s3_bucket: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No keys in the config or env: credentials come from the shared file `aws configure` writes."""
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[kvb]\naws_access_key_id = {seaweedfs.access_key}\naws_secret_access_key = {seaweedfs.secret_key}\n"
    )
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "kvb")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = seaweedfs.config(s3_bucket)
    del cfg["aws_access_key_id"], cfg["aws_secret_access_key"]
    with S3Store(S3Config.parse(cfg)) as store:
        assert store.put_many([("p", b"profile")])[0].ok
        assert store.get("p") == b"profile"


def test_unreachable_server_is_a_per_item_transient_error(s3_bucket: str, seaweedfs: S3Server) -> None:
    from kvbucket.testing.s3_server import free_port

    cfg = seaweedfs.config(s3_bucket, s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_max_retries=2)
    with S3Store(S3Config.parse(cfg)) as store:
        start = time.monotonic()
        results = store.get_many(["a", "b"])
        assert time.monotonic() - start < 10
        assert all(
            isinstance(r.error, TransientStoreError) and "could not reach" in str(r.error) for r in results
        )
        with pytest.raises(TransientStoreError, match="could not reach"):
            list(store.list())


@pytest.mark.parametrize(("status", "code", "kind"), [
    (413, "EntityTooLarge", StoreError), (400, "InvalidArgument", StoreError),
    (403, "AccessDenied", AuthError),
])
def test_a_4xx_on_upload_is_permanent_and_sent_once(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, status: int, code: str, kind: type
) -> None:
    """Issue 29 item 7 on S3: a 4xx answer to a PUT is the answer (403 an AuthError), never retried;
    throttling, 5xx and resets are retried (test_throttling_and_5xx_are_retried,
    test_dropped_connections_are_retried)."""
    with open_store(seaweedfs, s3_bucket, s3_endpoint_url=fault_proxy.url) as store:
        fault_proxy.fail(status, code, times=100, methods={"PUT"})
        (r,) = store.put_many([("k", b"value")])
        assert type(r.error) is kind, r.error  # not a TransientStoreError
        assert fault_proxy.injected == 1  # sent once
        fault_proxy.clear()
        assert store.head("k") is None
