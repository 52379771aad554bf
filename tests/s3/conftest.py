"""Every S3 test starts from an environment without AWS settings, so a developer's or CI's own
AWS_* variables can neither change what a config resolves to nor reach a real account."""

from __future__ import annotations

import uuid

import pytest

AWS_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ALLOW_HTTP",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_CA_BUNDLE",
    "AWS_PROFILE",
)


@pytest.fixture(autouse=True)
def _no_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fresh_prefix() -> str:
    """A prefix no other test uses: a store on it in ``s3_module_bucket`` starts empty."""
    return f"t-{uuid.uuid4().hex}"
