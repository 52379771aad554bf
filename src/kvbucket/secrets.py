"""Keep secrets out of every output: logs, error messages, reprs, ``kvbucket doctor``.

One function, :func:`redact`, decides for all of them. It masks with ``***``:

- every value under a key that names a secret (:func:`looks_secret`: ``token``, ``secret``,
  ``password``, ``key``, ``keyring``, ``credential``, ``auth``, ... in any spelling, misspelt
  keys included, but not ``*_env``/``*_file`` keys, which name where a secret is kept);
- the userinfo of URLs (``http://user:pass@host`` -> ``http://***@host``);
- credential shapes in text: header values, bearer tokens, Hub/Xet tokens, JWTs, base64 AES
  keys, URL signatures, ``key=value`` and ``"key": "value"`` pairs whose key names a secret;
- the secrets this process was given in its environment (values of secret-named variables,
  the keys of a JSON keyring, passwords in URL-valued variables), wherever they appear;
- and any secret passed in explicitly.

Mappings and sequences are redacted structurally (a copy); text by the rules above.
:func:`install_log_redaction` applies it to every log record of the process, kvbucket's and
its HTTP clients' (installed when :mod:`kvbucket` is imported).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pydantic is not imported for this: ``import kvbucket`` stays light
    from pydantic import SecretStr

T = TypeVar("T")
MASK = "***"

# ---- which names hold secrets ---------------------------------------------------------------------
#: a name holding one of these words holds a secret
_SECRET_WORDS = frozenset({
    "token", "secret", "secrets", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
    "key", "keyring", "apikey", "auth", "authorization", "cookie", "signature", "sig", "private",
})
#: ... or one of these run together (``accessToken``, ``hftoken``, ``SecretAccessKey``, ``mypassword``)
_SECRET_PARTS = ("token", "secret", "passw", "credential", "keyring", "apikey", "accesskey", "privatekey")
#: names ending so say where a secret is kept (``token_env``, ``keyring_file``), not the secret
_WHERE_SUFFIXES = ("_env", "_file", "_path", "_dir", "_source")
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def looks_secret(name: str) -> bool:
    """True when a setting, field or variable called ``name`` holds a secret.

    Counts (``tokens``, ``num_tokens``, ``chunk_tokens``) are not secrets."""
    low = name.lower()
    if low.endswith(_WHERE_SUFFIXES):
        return False
    words = [w.lower() for w in _WORD.findall(name)]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(part in w for w in words if w != "tokens" for part in _SECRET_PARTS) or any(
        part in low.replace("_", "").replace("-", "") for part in ("accesskey", "secretkey", "apikey")
    )


# ---- secrets this process was given --------------------------------------------------------------
_MIN_ENV_SECRET = 8  # shorter values ("true", "us") would mask harmless text


def _leaves(value: Any, *, all_strings: bool) -> list[str]:
    """String leaves of a parsed JSON value: all of them, or those under secret-looking keys."""
    out: list[str] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            out += _leaves(v, all_strings=all_strings or looks_secret(str(k)))
    elif isinstance(value, list):
        for v in value:
            out += _leaves(v, all_strings=all_strings)
    elif isinstance(value, str) and all_strings:
        out.append(value)
    return out


def secrets_in_env(env: Mapping[str, str]) -> list[str]:
    """The secrets an environment holds: values of secret-named variables (and every string in
    them when they are JSON: a keyring's keys), secret-keyed values in JSON variables, and
    passwords in URL userinfo. Longest first, so a secret containing another is masked whole."""
    found: set[str] = set()
    for name, value in env.items():
        secret_name = looks_secret(name)
        if secret_name:
            found.add(value)
        stripped = value.strip()
        if stripped.startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                found.update(_leaves(json.loads(stripped), all_strings=secret_name))
        for userinfo in _USERINFO.findall(value):
            found.add(userinfo)
            found.add(userinfo.partition(":")[2])
    return sorted((s for s in found if len(s) >= _MIN_ENV_SECRET), key=len, reverse=True)


_env_lock = threading.Lock()
_env_cache: tuple[dict[Any, Any], list[str]] | None = None


def _process_secrets() -> list[str]:
    """:func:`secrets_in_env` of ``os.environ``, recomputed only when the environment changed."""
    global _env_cache
    data = getattr(os.environ, "_data", None)  # the raw dict: comparing it is ~1 us, decoding ~100
    with _env_lock:
        if data is not None and _env_cache is not None and _env_cache[0] == data:
            return _env_cache[1]
        found = secrets_in_env(dict(os.environ))
        if data is not None:
            _env_cache = (dict(data), found)
        return found


# ---- credential shapes in text ---------------------------------------------------------------------
_USERINFO = re.compile(r"(?<=://)([^/@\s'\"]+)@")
_HEADER_NAMES = (
    r"x-xet-[\w-]+|authorization|proxy-authorization|cookie|set-cookie|x-amz-security-token|"
    r"x-api-key|x-amz-server-side-encryption-customer-key"
)
_QUOTED_HEADER = rf"""(?i)(b?(['"])(?:{_HEADER_NAMES})\2\s*[,:]\s*b?)(['"])(?:\\.|(?!\3).)*\3"""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (_USERINFO, MASK + "@"),
    # a header in a tuple, dict or list repr: (b'X-Xet-Access-Token', b'...'), 'authorization': '...'
    (re.compile(_QUOTED_HEADER), r"\1\3***\3"),
    # a raw header line: Authorization: Bearer abc / X-Xet-Access-Token: abc
    (re.compile(rf"(?i)\b({_HEADER_NAMES})(\s*:\s*)(?!\*\*\*)[^\r\n'\",]+"), r"\1\2***"),
    (re.compile(r"(?i)\b(bearer|basic)\s+(?!\*\*\*)[\w.~+/=-]+"), r"\1 ***"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "hf_***"),  # Hub user/org tokens
    (re.compile(r"\bxet_[\w-]{8,}\.[\w.-]+"), "xet_***"),  # the emulator's Xet tokens
    (re.compile(r"\beyJ[\w-]{6,}\.[\w-]+(?:\.[\w-]+)?"), MASK),  # JWTs (Xet tokens on the Hub)
    (re.compile(r"(?<![\w+/])[A-Za-z0-9+/]{43}="), MASK),  # base64 of 32 bytes: an AES-256 key
    (re.compile(r"(?i)\b(x-amz-(?:signature|security-token|credential))=[^&\s'\"]+"), r"\1=***"),
    (re.compile(r"(?i)([?&](?:signature|sig|token|key-pair-id|policy)=)[^&\s'\"]+"), r"\1***"),
)
# ``name: value`` / ``name=value`` / ``"name": "value"``; the value is masked when the name looks secret
_PAIR = re.compile(r"""(?<![\w.-])(b?["']?)([A-Za-z_][\w.-]*)\1\s*[:=]\s*""")
_NOT_SECRET_VALUES = ("None", "null", "true", "false", "True", "False")
_BARE_VALUE = re.compile(r"[^\s,;&}\])'\"]*")
_CLOSE = {"{": "}", "[": "]", "(": ")"}
_TRIGGER = re.compile(
    r"(?i)x-xet|authoriz|bearer|basic |token|cookie|hf_|xet_|eyj|x-amz-|signature|sig=|secret|policy=|"
    r"passw|pwd|credential|key|auth|://[^/\s]*@|="
)


def _value_end(text: str, i: int) -> int:
    """Where the value starting at ``text[i]`` ends: a quoted string, a bracketed group, or a word."""
    if i >= len(text):
        return i
    c = text[i]
    if c == "b" and text[i + 1:i + 2] in ("'", '"'):
        i, c = i + 1, text[i + 1]
    if c in "'\"":
        j = i + 1
        while j < len(text) and text[j] != c:
            j += 2 if text[j] == "\\" else 1
        return min(j + 1, len(text))
    if c in _CLOSE:
        depth, j = 0, i
        while j < len(text):
            if text[j] in _CLOSE:
                depth += 1
            elif text[j] in _CLOSE.values():
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return len(text)
    m = _BARE_VALUE.match(text, i)
    return m.end() if m else i


def _mask_pairs(text: str) -> str:
    out, pos = [], 0
    for m in _PAIR.finditer(text):
        if m.start() < pos or not looks_secret(m.group(2)):
            continue
        start = m.end()
        end = _value_end(text, start)
        value = text[start:end].strip("b'\"")
        if not value or value.startswith(MASK) or value.isdigit() or value in _NOT_SECRET_VALUES:
            continue
        out.append(text[pos:start])
        quote = text[start] if text[start:start + 1] in ("'", '"') else ""
        out.append(f"{quote}{MASK}{quote}")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _redact_text(text: str, known: tuple[str, ...]) -> str:
    for s in known:
        if s in text:
            text = text.replace(s, MASK)
    if not _TRIGGER.search(text):
        return text
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return _mask_pairs(text)


def _is_secret_type(value: Any) -> bool:
    """A pydantic ``SecretStr``/``SecretBytes`` (told by its method: pydantic is not imported here)."""
    return callable(getattr(value, "get_secret_value", None))


def reveal(value: SecretStr | str | None) -> str | None:
    """Return the plain secret, for handing to a client library only."""
    if value is None:
        return None
    if _is_secret_type(value):
        return value.get_secret_value()  # type: ignore[union-attr]
    return value


def redact(value: T, *secrets: Any) -> T:
    """``value`` with every secret masked (see the module docstring): text, or a copy of a mapping
    or sequence. ``secrets`` (strings or SecretStrs) are masked too, wherever they appear."""
    known = [p for s in secrets if (isinstance(s, str) or _is_secret_type(s)) and (p := reveal(s))
             and isinstance(p, str) and len(p) >= 4]
    return _redact(value, tuple(sorted({*known, *_process_secrets()}, key=len, reverse=True)))


def _redact(value: Any, known: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return _redact_text(value, known)
    if _is_secret_type(value):
        return MASK
    if isinstance(value, Mapping):
        return {k: (MASK if looks_secret(str(k)) and v not in (None, "", False) else _redact(v, known))
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_redact(v, known) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


# ---- every log record of the process ----------------------------------------------------------------
# The HTTP clients under huggingface_hub log response headers at DEBUG (httpcore's trace lines print
# every header, X-Xet-Access-Token included, and httpx the URL with its userinfo). A logger filter
# would not reach those records (filters do not apply to child loggers, and the clients' logger names
# vary between versions), so the process's log record factory is wrapped instead.
_log_lock = threading.Lock()
_log_installed = False


def _redact_record(record: logging.LogRecord) -> None:
    try:
        msg = record.getMessage()
    except Exception:  # a record whose args do not format: left to logging to report
        return
    red = redact(msg)
    if red != msg:
        record.msg = red
        record.args = None


def install_log_redaction() -> None:
    """Wrap the log record factory so every record is redacted when created. Idempotent."""
    global _log_installed
    with _log_lock:
        if _log_installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            _redact_record(record)
            return record

        logging.setLogRecordFactory(factory)
        _log_installed = True


__all__ = ["MASK", "install_log_redaction", "looks_secret", "redact", "reveal", "secrets_in_env"]
