"""The S3 configuration model and how its endpoint forms resolve to a bucket, endpoint and style.

Field names are LMCache's (seed 004), so the non-MP ``extra_config`` dict and the MP adapter
JSON both validate straight into :class:`S3Config`; the ``s3_endpoint_url`` /
``s3_addressing_style`` / ``s3_ca_bundle`` / ``s3_proxy_url`` fields are what users of MinIO,
SeaweedFS or Ceph need and LMCache lacks. The model is import-light (pydantic only) so that
subclasses (the MP adapter config) can import it without pulling in the S3 client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from kvbucket.did_you_mean import unknown_key_hint
from kvbucket.errors import ConfigError
from kvbucket.stores.base import check_prefix
from kvbucket.stores.part_sizes import check_part_bytes

MiB = 1024 * 1024
# S3 refuses parts below 5 MiB (except the last one) and allows at most 10,000 parts.
MIN_PART_SIZE = 5 * MiB

_EXPRESS_HOST = re.compile(
    r"^(?P<bucket>[^/]+?)\.s3express-(?P<az>[a-z0-9-]+)\.(?P<region>[a-z0-9-]+)\.amazonaws\.com$"
)
_AWS_REGIONAL_HOST = re.compile(r"^(?P<bucket>[^/]+?)\.s3[.-](?P<region>[a-z0-9-]+)\.amazonaws\.com$")
_AWS_GLOBAL_HOST = re.compile(r"^(?P<bucket>[^/]+?)\.s3\.amazonaws\.com$")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class S3Config(BaseModel):
    """Where an S3 store lives and how to talk to it. Unknown keys are errors (typos must not pass).

    ``s3_endpoint`` is ``s3://bucket[/prefix]`` or a bare host: ``bucket.s3.<region>.amazonaws.com``,
    ``<bucket>.s3express-<az>.<region>.amazonaws.com``, or a virtual-hosted S3-compatible host such as
    ``test-127.cwlota.com`` (bucket ``test-127``). With ``s3_endpoint_url`` the part after ``s3://``
    is the bucket name and requests go to that URL (path-style by default).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    s3_endpoint: str = Field(description="s3://bucket[/prefix] or a bare bucket host")
    s3_region: str | None = Field(None, description="SigV4 region; required for AWS")
    s3_num_io_threads: int = Field(
        64, ge=1, le=1024,
        description="requests in flight per store: direct reads (and obstore's re-reads of them) across "
        "all its calls; obstore's worker threads",
    )
    s3_prefer_http2: bool = Field(False, description="offer h2 via ALPN on TLS connections")
    s3_enable_s3express: bool = Field(False, description="S3 Express One Zone session auth and endpoints")
    disable_tls: bool = Field(False, description="plain http:// to the endpoint (non-AWS services)")
    aws_access_key_id: SecretStr | None = None
    aws_secret_access_key: SecretStr | None = None
    aws_session_token: SecretStr | None = None
    # What MinIO/SeaweedFS/Ceph users need and LMCache lacks.
    s3_endpoint_url: str | None = Field(None, description="custom endpoint, e.g. http://127.0.0.1:8333")
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    s3_ca_bundle: str | None = Field(None, description="PEM file of extra CA certificates to trust")
    s3_proxy_url: str | None = Field(None, description="HTTP proxy for every request")
    # Transfer tuning.
    s3_unsigned_payload: bool | None = Field(
        None, description="skip SHA-256 of bodies in signatures; default: yes over TLS, no over plain HTTP"
    )
    s3_multipart_threshold: int = Field(
        64 * MiB, ge=MIN_PART_SIZE, description="bytes; larger puts use multipart"
    )
    s3_multipart_part_size: int = Field(16 * MiB, ge=MIN_PART_SIZE, description="bytes per multipart part")
    s3_max_retries: int = Field(5, ge=0, le=50, description="retries of throttled/5xx/timed-out requests")
    s3_retry_timeout_secs: float = Field(30.0, gt=0, description="stop retrying a request after this long")
    s3_request_timeout_secs: float = Field(60.0, gt=0, description="one HTTP request, connect to last byte")
    s3_connect_timeout_secs: float = Field(5.0, gt=0, description="TCP+TLS connect of one request")
    # Deadlines (docs/reliability.md): every verb has a total budget, retries included. Lookups
    # and loads are on the inference path (a miss is cheaper than a stall); stores run behind it.
    s3_lookup_timeout_secs: float = Field(
        1.0, gt=0, le=3600,
        description="total of head_many, and of get_many's wait for a first answer (inference path): "
        "past it, items fail",
    )
    s3_load_timeout_secs: float = Field(
        5.0, gt=0, le=3600, description="total of get_many (inference path): past it, items fail"
    )
    s3_store_timeout_secs: float = Field(
        120.0, gt=0, le=86400, description="total of put_many/delete_many: past it, items fail"
    )
    s3_breaker_failures: int = Field(
        5, ge=0, le=1000, description="consecutive failed calls that open the breaker; 0: off"
    )
    s3_breaker_cooldown_secs: float = Field(
        10.0, ge=0, le=3600, description="open breaker: seconds before one call probes the store"
    )
    s3_read_part_bytes: int = Field(
        8 * MiB,
        description="objects of at least twice this, loaded into a caller's buffer, are read with ranged "
        "GETs of about this size in parallel (one connection each, as awscrt does); 0: one GET each "
        "(else at least 65536)",
    )
    s3_read_min_part_bytes: int = Field(
        2 * MiB,
        description="a load with fewer parts than s3_num_io_threads reads its objects in smaller parts, "
        "down to this size, until about s3_num_io_threads GETs are in flight; 0: parts of "
        "s3_read_part_bytes only (else at least 65536)",
    )
    s3_direct_reads: bool = Field(
        True,
        description="GETs presigned by obstore and run by libcurl (pycurl), bodies written straight "
        "into the caller's buffers; false sends every request through obstore",
    )

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint_not_empty(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("s3_endpoint is empty; use s3://bucket[/prefix]")
        return v

    @field_validator("s3_read_part_bytes", "s3_read_min_part_bytes", mode="before")
    @classmethod
    def _part_floor(cls, v: object, info: ValidationInfo) -> int:
        """0 or 64 KiB..1 TiB, spelt as every part-size setting is (part_sizes.check_part_bytes)."""
        return check_part_bytes("", v)  # the model's error names the field

    @field_validator("s3_region")
    @classmethod
    def _region_not_blank(cls, v: str | None) -> str | None:
        return v.strip() or None if v is not None else None

    @field_validator("s3_endpoint_url", "s3_proxy_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http:// or https:// URL")
        if parts.username or parts.password:
            raise ValueError("put credentials in aws_access_key_id/aws_secret_access_key, not in the URL")
        if parts.query or parts.fragment:  # requests are signed for the path: a query would go astray
            raise ValueError("must not carry a query or fragment ('?...', '#...'): give the server's "
                             "scheme, host, port (and path), e.g. http://127.0.0.1:8333")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _keys_in_pairs(self) -> S3Config:
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise ValueError("set both aws_access_key_id and aws_secret_access_key, or neither")
        if self.s3_multipart_part_size > self.s3_multipart_threshold:
            raise ValueError("s3_multipart_part_size must not exceed s3_multipart_threshold")
        return self

    @classmethod
    def parse(cls, data: dict[str, object]) -> S3Config:
        """Validate a dict, turning pydantic's errors into one :class:`ConfigError` naming each key."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_describe(e, cls.__name__)) from None

    def resolve(self) -> S3Target:
        return resolve_target(self)


def _describe(e: object, what: str) -> str:
    problems = []
    for err in e.errors():  # type: ignore[attr-defined]
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            hint = unknown_key_hint(S3Config, err["loc"]).strip()
            problems.append(f"unknown key {loc!r}" + (f" ({hint})" if hint else ""))
        else:  # never echo input values: they may be secrets
            problems.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    return f"invalid {what}: " + "; ".join(problems)


@dataclass(frozen=True, slots=True)
class S3Target:
    """A resolved S3 location: what the client needs, with nothing secret in it."""

    bucket: str
    prefix: str
    endpoint: str | None  # None: the client derives AWS's endpoint from bucket + region
    virtual_hosted: bool
    region: str | None
    aws: bool
    express: bool
    allow_http: bool

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def resolve_target(cfg: S3Config) -> S3Target:
    """Turn ``s3_endpoint`` (+ ``s3_endpoint_url``/style/TLS) into a bucket, endpoint and style."""
    raw = cfg.s3_endpoint
    for scheme in ("s3://", "s3a://"):
        if raw.startswith(scheme):
            raw = raw[len(scheme) :]
            break
    else:
        if "://" in raw:
            raise ConfigError(
                f"s3_endpoint {cfg.s3_endpoint!r} must be s3://bucket[/prefix] or a bare bucket host; "
                "put http(s):// endpoints of S3-compatible servers in s3_endpoint_url"
            )
    host, _, path = raw.partition("/")
    try:
        prefix = check_prefix(path)
    except Exception as e:
        raise ConfigError(f"bad prefix in s3_endpoint {cfg.s3_endpoint!r}: {e}") from None
    if not host:
        raise ConfigError(f"s3_endpoint {cfg.s3_endpoint!r} names no bucket")
    style = cfg.s3_addressing_style
    scheme = "http" if cfg.disable_tls else "https"

    if cfg.s3_endpoint_url is not None:  # custom endpoint: the host part is the bucket name
        url = urlsplit(cfg.s3_endpoint_url)
        if cfg.disable_tls and url.scheme == "https":
            raise ConfigError("disable_tls is set but s3_endpoint_url is https://; use an http:// URL")
        bucket = _check_bucket(host, cfg)
        virtual = style == "virtual"
        endpoint = cfg.s3_endpoint_url
        if virtual:
            endpoint = f"{url.scheme}://{bucket}.{url.netloc}{url.path}"
        return S3Target(
            bucket,
            prefix,
            endpoint,
            virtual,
            cfg.s3_region,
            False,
            cfg.s3_enable_s3express,
            url.scheme == "http",
        )

    m = _EXPRESS_HOST.match(host)
    if m:
        bucket = _check_bucket(m["bucket"], cfg)
        region = _aws_region(cfg, m["region"])
        if not cfg.s3_enable_s3express:
            raise ConfigError(
                f"s3_endpoint {host!r} is an S3 Express One Zone endpoint; set s3_enable_s3express: true"
            )
        return S3Target(
            bucket,
            prefix,
            None if not cfg.disable_tls else f"http://{host}",
            True,
            region,
            True,
            True,
            cfg.disable_tls,
        )
    m = _AWS_REGIONAL_HOST.match(host) or _AWS_GLOBAL_HOST.match(host)
    if m or "." not in host.split(":")[0]:
        bucket = _check_bucket(m["bucket"] if m else host, cfg)
        region = _aws_region(cfg, m.groupdict().get("region") if m else None)
        virtual = style != "path"
        endpoint = None
        if cfg.disable_tls:
            endpoint = (
                f"http://{bucket}.s3.{region}.amazonaws.com"
                if virtual
                else f"http://s3.{region}.amazonaws.com"
            )
        return S3Target(
            bucket, prefix, endpoint, virtual, region, True, cfg.s3_enable_s3express, cfg.disable_tls
        )

    # A bare virtual-hosted host of an S3-compatible service: bucket.service-host[:port].
    bucket, _, service = host.partition(".")
    bucket = _check_bucket(bucket, cfg)
    if style == "path":
        return S3Target(
            bucket,
            prefix,
            f"{scheme}://{service}",
            False,
            cfg.s3_region,
            False,
            cfg.s3_enable_s3express,
            cfg.disable_tls,
        )
    return S3Target(
        bucket,
        prefix,
        f"{scheme}://{host}",
        True,
        cfg.s3_region,
        False,
        cfg.s3_enable_s3express,
        cfg.disable_tls,
    )


def _check_bucket(bucket: str, cfg: S3Config) -> str:
    if not _BUCKET.match(bucket):
        raise ConfigError(f"{bucket!r} (from s3_endpoint {cfg.s3_endpoint!r}) is not a valid bucket name")
    return bucket


def _aws_region(cfg: S3Config, from_host: str | None) -> str:
    if cfg.s3_region and from_host and cfg.s3_region != from_host:
        raise ConfigError(
            f"s3_region {cfg.s3_region!r} differs from the region in s3_endpoint ({from_host!r})"
        )
    region = cfg.s3_region or from_host
    if not region:
        raise ConfigError(
            f"s3_region is required for AWS S3 (s3_endpoint {cfg.s3_endpoint!r}): set s3_region, e.g. "
            "'us-east-1' (or AWS_REGION for the CLI). For an S3-compatible server set s3_endpoint_url."
        )
    return region


__all__ = ["MIN_PART_SIZE", "S3Config", "S3Target", "resolve_target"]
