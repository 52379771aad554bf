"""Building ``S3Store``'s clients: obstore's S3 client from an :class:`S3Config`, the direct
libcurl reader next to it, boto3's credential chain when installed, and the fork guard.

obstore's I/O runtime (tokio) does not survive ``fork()``: a process forked after its parent made
S3 calls would hang on every call, so it gets an error that says what to do instead.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from obstore.store import S3Store as _ObS3Store

from kvbucket.errors import ConfigError, StoreError
from kvbucket.secrets import redact, reveal
from kvbucket.stores.s3.config import S3Config, S3Target
from kvbucket.stores.s3.direct import DirectReader

# ---- fork -------------------------------------------------------------------------------

# The process whose S3 calls started obstore's I/O runtime. tokio's threads do not survive
# fork(), so in a child forked after that every obstore call would hang forever (obstore is not
# fork-safe; a store opened anew in the child hangs too). Such a child gets an error instead.
_RUNTIME_PID: int | None = None
_RUNTIME_LOCK = threading.Lock()


def claim_runtime() -> None:
    global _RUNTIME_PID
    pid = os.getpid()
    if pid == _RUNTIME_PID:
        return
    with _RUNTIME_LOCK:
        if _RUNTIME_PID is None:
            _RUNTIME_PID = pid
            return
    raise StoreError(
        f"S3 stores cannot be used in this process: it was forked (pid {_RUNTIME_PID} -> {pid}) after "
        "the parent had made S3 calls, and the S3 client's I/O threads do not survive fork(), so "
        "every call would hang. Start workers with multiprocessing's 'spawn' or 'forkserver' "
        "method (vLLM: VLLM_WORKER_MULTIPROC_METHOD=spawn), or make the first S3 call only after "
        "forking."
    )


# ---- construction -----------------------------------------------------------------------


def build_client(cfg: S3Config, target: S3Target) -> _ObS3Store:
    config: dict[str, Any] = {"virtual_hosted_style_request": target.virtual_hosted}
    if target.endpoint is not None:
        config["endpoint"] = target.endpoint
    if target.region:
        config["region"] = target.region
    elif not target.aws:
        config["region"] = "us-east-1"  # S3-compatible servers sign with any region; this is boto3's default
    if target.express:
        config["s3_express"] = True
    unsigned = cfg.s3_unsigned_payload if cfg.s3_unsigned_payload is not None else not target.allow_http
    config["unsigned_payload"] = unsigned
    credential_provider = None
    if cfg.aws_access_key_id is not None:
        config["access_key_id"] = reveal(cfg.aws_access_key_id)
        config["secret_access_key"] = reveal(cfg.aws_secret_access_key)
        if cfg.aws_session_token is not None:
            config["token"] = reveal(cfg.aws_session_token)
    else:
        credential_provider = default_credentials()

    client: dict[str, Any] = {
        "allow_http": target.allow_http,
        "http1_only": not cfg.s3_prefer_http2,
        "timeout": timedelta(seconds=cfg.s3_request_timeout_secs),
        "connect_timeout": timedelta(seconds=cfg.s3_connect_timeout_secs),
        "pool_max_idle_per_host": str(cfg.s3_num_io_threads),
        # Chunks are opaque bytes; saying so spares servers and proxies content sniffing.
        "default_content_type": "application/octet-stream",
    }
    if cfg.s3_ca_bundle:
        path = Path(cfg.s3_ca_bundle).expanduser()
        try:
            pem = path.read_text()
        except OSError as e:
            raise ConfigError(f"s3_ca_bundle {str(path)!r} cannot be read: {e.strerror}") from None
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ConfigError(f"s3_ca_bundle {str(path)!r} holds no PEM certificate")
        client["root_certificate"] = pem
    if cfg.s3_proxy_url:
        client["proxy_url"] = cfg.s3_proxy_url
    retry: dict[str, Any] = {
        "max_retries": cfg.s3_max_retries,
        "retry_timeout": timedelta(seconds=cfg.s3_retry_timeout_secs),
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
    }
    try:
        return _ObS3Store(
            target.bucket,
            prefix=target.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
            credential_provider=credential_provider,
        )
    except Exception as e:
        raise ConfigError(
            f"cannot configure the S3 client for {target.url}: "
            f"{redact(str(e).splitlines()[0], cfg.aws_secret_access_key)}"
        ) from None


def direct_reader(cfg: S3Config, target: S3Target, store: _ObS3Store) -> DirectReader | None:
    """Direct reads when requests go straight to the endpoint over HTTP/1.1, plain or TLS (s3/direct.py).

    Proxies, HTTP/2 and S3 Express session auth stay with obstore, which implements them.
    """
    if not cfg.s3_direct_reads or cfg.s3_proxy_url or cfg.s3_prefer_http2 or target.express:
        return None
    return DirectReader(
        store,
        ca_bundle=str(Path(cfg.s3_ca_bundle).expanduser()) if cfg.s3_ca_bundle else None,
        timeout=cfg.s3_request_timeout_secs,
        connect_timeout=cfg.s3_connect_timeout_secs,
        max_parallel=cfg.s3_num_io_threads,
        part_bytes=cfg.s3_read_part_bytes,
        min_part_bytes=cfg.s3_read_min_part_bytes,
    )


def default_credentials() -> Any:
    """boto3's default chain (profiles from ``aws configure``, SSO, env, IMDS) when boto3 is installed.

    obstore's own chain covers env vars, web identity, containers and IMDS but not shared profile
    files, which is where ``aws configure`` writes; without boto3 obstore's chain is used.
    """
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None  # obstore reads the standard env vars itself
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None
    return Boto3CredentialProvider(session)


__all__ = ["build_client", "claim_runtime", "default_credentials", "direct_reader"]
