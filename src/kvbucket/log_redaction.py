"""Keep credentials out of every log record of the process: kvbucket's and its clients'.

The HTTP clients under huggingface_hub log response headers at DEBUG (httpcore's trace lines
print every header, ``X-Xet-Access-Token`` included), and presigned URLs carry signatures. A
logger filter would not reach those records (filters do not apply to child loggers, and the
clients' logger names vary between versions), so kvbucket wraps the process's log record
factory instead: when a record is created, its formatted message is scanned, and header
values, bearer tokens, Hub/Xet tokens and URL signatures are replaced by ``***``. Records
without any of the trigger words pass untouched (one case-insensitive search).

Installed once when :mod:`kvbucket` is imported; :func:`redact_log_text` is the pure function.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

_HEADER_NAMES = (
    r"x-xet-[\w-]+|authorization|proxy-authorization|cookie|set-cookie|x-amz-security-token|"
    r"x-api-key|x-amz-server-side-encryption-customer-key"
)
_QUOTED_HEADER = rf"""(?i)(b?(['"])(?:{_HEADER_NAMES})\2\s*[,:]\s*b?)(['"])(?:\\.|(?!\3).)*\3"""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # a header in a tuple, dict or list repr: (b'X-Xet-Access-Token', b'...'), 'authorization': '...'
    (re.compile(_QUOTED_HEADER), r"\1\3***\3"),
    # a raw header line: Authorization: Bearer abc / X-Xet-Access-Token: abc
    (re.compile(rf"(?i)\b({_HEADER_NAMES})(\s*:\s*)(?!\*\*\*)[^\r\n'\",]+"), r"\1\2***"),
    (re.compile(r"(?i)\b(bearer|basic)\s+(?!\*\*\*)[\w.~+/=-]+"), r"\1 ***"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "hf_***"),  # Hub user/org tokens
    (re.compile(r"\bxet_[\w-]{8,}\.[\w.-]+"), "xet_***"),  # the emulator's Xet tokens
    (re.compile(r"\beyJ[\w-]{6,}\.[\w-]+(?:\.[\w-]+)?"), "***"),  # JWTs (Xet tokens on the Hub)
    (re.compile(r"""(?i)((?<![\w-])["']?(?:access_?token|accesstoken|token|secret_access_key|session_token)"""
                r"""["']?\s*[:=]\s*["']?)(?!\*\*\*)[^"'\s,&}]{4,}"""), r"\1***"),
    (re.compile(r"(?i)\b(x-amz-(?:signature|security-token|credential))=[^&\s'\"]+"), r"\1=***"),
    (re.compile(r"(?i)([?&](?:signature|sig|token|key-pair-id|policy)=)[^&\s'\"]+"), r"\1***"),
)
_TRIGGER = re.compile(
    r"(?i)x-xet|authoriz|bearer|basic |token|cookie|hf_|xet_|eyj|x-amz-|signature|sig=|secret|policy="
)

_lock = threading.Lock()
_installed = False


def redact_log_text(text: str) -> str:
    """``text`` with credential values replaced by ``***`` (header values, tokens, signatures)."""
    if not _TRIGGER.search(text):
        return text
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def _redact_record(record: logging.LogRecord) -> None:
    try:
        msg = record.getMessage()
    except Exception:  # a record whose args do not format: left to logging to report
        return
    red = redact_log_text(msg)
    if red is not msg and red != msg:
        record.msg = red
        record.args = None


def install_log_redaction() -> None:
    """Wrap the log record factory so every record is redacted when created. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            _redact_record(record)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True


__all__ = ["install_log_redaction", "redact_log_text"]
