"""S3 options a user did not set, from the standard AWS environment variables.

Explicit options always win; the key pair is taken from the environment only when neither key is
given, so a lone ``aws_secret_access_key`` (or ``aws_access_key_id``) in a config reaches
:class:`~kvbucket.stores.s3.config.S3Config`, which refuses it ("both or neither"), instead of
being silently completed or replaced by the environment's keys.
"""

from __future__ import annotations

import os
from typing import Any


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def fill_from_env(opts: dict[str, Any], *, endpoint: bool) -> dict[str, Any]:
    """Options not set explicitly, from the standard AWS env vars (explicit values always win; a
    key pair only when neither key is given)."""
    env = os.environ
    endpoint_url = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint and "s3_endpoint_url" not in opts and endpoint_url:
        opts["s3_endpoint_url"] = endpoint_url
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if "s3_region" not in opts and region:
        opts["s3_region"] = region
    given = "aws_access_key_id" in opts or "aws_secret_access_key" in opts  # a lone one: S3Config refuses
    if not given and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        opts["aws_access_key_id"] = env["AWS_ACCESS_KEY_ID"]
        opts["aws_secret_access_key"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            opts["aws_session_token"] = env["AWS_SESSION_TOKEN"]
    if "disable_tls" not in opts and _env_flag("AWS_ALLOW_HTTP") and not opts.get("s3_endpoint_url"):
        opts["disable_tls"] = True
    if "s3_addressing_style" not in opts and _env_flag("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"):
        opts["s3_addressing_style"] = "virtual"
    if "s3_ca_bundle" not in opts and env.get("AWS_CA_BUNDLE"):
        opts["s3_ca_bundle"] = env["AWS_CA_BUNDLE"]
    return opts


__all__ = ["fill_from_env"]
