"""No token reaches a log record: kvbucket's and its HTTP clients', at DEBUG, in real HF store
operations against the Hub emulator (driven by unmodified huggingface_hub / hf_xet)."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from kvbucket.secrets import redact as redact_log_text
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore


def make_store(hub: Any, bucket_id: str, prefix: str) -> HFBucketStore:
    return HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{bucket_id}/{prefix}", token=hub.write_token, endpoint=hub.endpoint,
        token_env="", retry_backoff_secs=0.01,
    ))


XET_TOKEN = re.compile(r"xet_[\w-]{8,}\.[\w.-]+|eyJ[\w-]{6,}\.[\w-]+")


def test_debug_logs_of_real_store_operations_hold_no_token(
    hub_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hub = hub_bucket.hub
    started = time.time()
    caplog.set_level(logging.DEBUG)  # every logger: kvbucket, huggingface_hub, httpx, httpcore
    with make_store(hub, hub_bucket.bucket_id, prefix="redaction") as store:
        assert all(r.ok for r in store.put_many([("big", b"x" * 300_000), ("small", b"y")]))
        assert store.get("big") == b"x" * 300_000
        assert store.head("small") == 1
        assert sorted(i.name for i in store.list()) == ["big", "small"]
        store.delete("big")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "X-Xet-Access-Token', b'***'" in text, "the client logged Xet token headers (redacted)"
    assert hub.write_token not in text
    leaked = XET_TOKEN.findall(text)
    assert leaked == [], f"Xet tokens in the logs: {leaked[:3]}"
    assert "Bearer" not in text or "Bearer ***" in text
    # hf_xet's own (Rust) log files: not Python logging; it redacts its headers itself
    xet_logs = Path(os.environ.get("HF_XET_CACHE", Path.home() / ".cache/huggingface/xet")) / "logs"
    for f in xet_logs.glob("*.log") if xet_logs.is_dir() else []:
        if f.stat().st_mtime >= started - 1:
            body = f.read_text(errors="replace")
            assert hub.write_token not in body and XET_TOKEN.findall(body) == [], f"a token in {f}"


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("[(b'X-Xet-Access-Token', b'xet_abcdefghij.0123'), (b'X-Xet-Cas-Url', b'http://h/cas')]", "xet_abc"),
        ("{'authorization': 'Bearer hf_abcdefghijklmnopqrstuvwxyz1234'}", "hf_abc"),
        ("Authorization: Bearer opaque-token-value", "opaque-token"),
        ("PUT https://s3/b/k?X-Amz-Credential=AKIAX/y&X-Amz-Signature=deadbeef01 200", "deadbeef01"),
        ('{"accessToken": "eyJhbGciOiJI.eyJzdWIiOiIx.c2lnbmF0dXJl", "exp": 1}', "eyJhbGci"),
        ("x-amz-security-token: FQoGZXIvYXdzEBYaDH", "FQoGZXIv"),
    ],
)
def test_redaction_of_credential_shapes(line: str, secret: str, caplog: pytest.LogCaptureFixture) -> None:
    assert secret not in redact_log_text(line) and "***" in redact_log_text(line)
    caplog.set_level(logging.DEBUG)
    logging.getLogger("some.http.client").debug("headers %s", line)  # any logger, args formatted
    assert secret not in caplog.text and "***" in caplog.text


def test_harmless_text_is_untouched() -> None:
    line = "put of 12 chunks (num_token: 256, chunk_tokens=4, token_source=env) in 3.1 ms"
    assert redact_log_text(line) == line
