"""Keep secrets out of every output: logs, error messages, reprs, ``kvbucket doctor``.

One function, :func:`redact`, decides for all of them, by value and by structure, never by the
words of a sentence. It masks with ``***``:

- the values of known secrets, wherever they appear: what this process was given in its
  environment (values of variables whose name says they hold a secret, ``HF_TOKEN``,
  ``AWS_SECRET_ACCESS_KEY``, every string of a JSON keyring, passwords in URL userinfo, the
  tokens of ``$KVBUCKET_EMULATOR_TOKENS``), what was handed to a client (:func:`reveal`),
  what a loader met (keyring keys, emulator tokens: :func:`remember`), and any secret passed in;
- the userinfo of URLs (``s3://KEY:SECRET@bucket`` -> ``s3://***@bucket``), and that userinfo
  wherever else the text (or a later one) repeats it;
- credential shapes: header values, bearer tokens, Hub/Xet tokens, JWTs, base64 AES-256 keys,
  presigned URL signatures;
- values of a mapping under a key that names a secret (:func:`looks_secret`), and of such
  ``key=value`` / ``"key": "value"`` pairs in reprs and configs (a value quoted or bracketed,
  after ``=``, or after ``key:`` where a config or repr puts its keys). A sentence that names a
  variable (``the token from $HF_TOKEN: ...``) is left as written.

Paths and ordinary words are never hidden: a variable's value that is an existing absolute path
is no secret (``$PWD``, ``$SSH_AUTH_SOCK``), and words alone (``pwd``) do not make one.
:func:`install_log_redaction` applies it to every log record of the process, kvbucket's and
other libraries', which it changes only where such a value appears.
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
    "token", "secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
    "key", "keyring", "apikey", "auth", "authorization", "cookie", "signature", "private",
})
#: ... or one of these run together (``accessToken``, ``hftoken``, ``SecretAccessKey``, ``mypassword``)
_SECRET_PARTS = ("token", "secret", "passw", "credential", "keyring", "apikey", "accesskey", "privatekey")
#: names ending so say where a secret is kept (``token_env``, ``keyring_file``), not the secret
_WHERE_SUFFIXES = ("_env", "_file", "_path", "_dir", "_source", "_sock", "_socket")
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
#: Values are masked wherever they appear from this length: shorter ones ("true", "us", a test's
#: "secret") would mask words. Shorter secrets are still masked where their place says so (URL
#: userinfo, ``USER=SECRET:SCOPE``, header values, secret-named keys).
_MIN_SECRET = 8
#: variables holding Hub emulator tokens, ``USER=SECRET:SCOPE`` separated by spaces or commas
_TOKEN_LISTS = ("KVBUCKET_EMULATOR_TOKENS",)
_REMEMBERED_MAX = 4096
_remembered: dict[str, None] = {}  # insertion-ordered: the oldest are forgotten past the cap
_remembered_lock = threading.Lock()


def remember(*values: Any) -> None:
    """Mask these secret values (strings or SecretStrs) in every later output of this process:
    called where a secret is met (a keyring key, an emulator token, a URL's userinfo)."""
    new = [v for v in (reveal(x) if _is_secret_type(x) else x for x in values)
           if isinstance(v, str) and len(v) >= _MIN_SECRET]
    if not new:
        return
    with _remembered_lock:
        for v in new:
            _remembered[v] = None
        while len(_remembered) > _REMEMBERED_MAX:
            del _remembered[next(iter(_remembered))]


def _userinfo_secrets(userinfo: str) -> list[str]:
    """The secrets of one URL userinfo: all of it, and the password of ``user:password``."""
    return [userinfo, userinfo.partition(":")[2]]


def _is_path(value: str) -> bool:
    """An existing absolute path (``$PWD``, a socket): where something is, not a secret."""
    return os.path.isabs(value) and os.path.exists(value)


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
    placed: set[str] = set()  # secrets known by their place
    for name, value in env.items():
        secret_name = looks_secret(name) and not _is_path(value)
        if secret_name:
            found.add(value)
        stripped = value.strip()
        if stripped.startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                found.update(_leaves(json.loads(stripped), all_strings=secret_name))
        for userinfo in _USERINFO.findall(value):
            placed.update(_userinfo_secrets(userinfo))
        if name in _TOKEN_LISTS:
            for spec in re.split(r"[\s,]+", value):
                placed.add(spec.partition("=")[2].rpartition(":")[0])
    return sorted((s for s in found | placed if len(s) >= _MIN_SECRET), key=len, reverse=True)


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
    # a Hub emulator token: USER=SECRET:SCOPE (--token, $KVBUCKET_EMULATOR_TOKENS)
    (re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*=)(?!\*\*\*:)[^\s:,='\"]+(:(?:read|write|fine-read))(?![\w-])"),
     r"\1***\2"),
)
# ``name: value`` / ``name=value`` / ``"name": "value"``; the value is masked when the name looks secret
_PAIR = re.compile(r"""(?<![\w.$-])(b?["']?)([A-Za-z_][\w.-]*)\1\s*([:=])\s*""")


def _at_key_place(text: str, i: int) -> bool:
    """Whether a key starting at ``text[i]`` is where a config or a repr puts its keys: a line's
    start (a YAML list item's too), after ``{`` or ``[``, or after a comma inside them."""
    j = i
    while j > 0 and text[j - 1] in "'\"b":
        j -= 1
    while j > 0 and text[j - 1] in " \t":
        j -= 1
    if j > 0 and text[j - 1] == "-":  # "- key: value"
        j -= 1
        while j > 0 and text[j - 1] in " \t":
            j -= 1
    if j == 0 or text[j - 1] in "\n{[":
        return True
    if text[j - 1] != ",":
        return False
    line = text[text.rfind("\n", 0, j) + 1 : j]
    return line.count("{") + line.count("[") > line.count("}") + line.count("]")
_NOT_SECRET_VALUES = ("None", "null", "true", "false", "True", "False")
_BARE_VALUE = re.compile(r"[^\s,;&}\])'\"]*")
_CLOSE = {"{": "}", "[": "]", "(": ")"}
_TRIGGER = re.compile(
    r"(?i)x-xet|authoriz|bearer|basic |token|cookie|hf_|xet_|eyj|x-amz-|signature|sig=|secret|policy=|"
    r"passw|credential|key|auth|private|://[^/\s]*@|="
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
    """Mask the values of secret-named keys where the text is a config or a repr, not prose:
    quoted or bracketed values, ``key=value``, and ``key: value`` where keys are put."""
    out, pos = [], 0
    for m in _PAIR.finditer(text):
        if m.start() < pos or not looks_secret(m.group(2)):
            continue
        start = m.end()
        bare = text[start:start + 1] not in ("'", '"', *_CLOSE) and text[start:start + 2] not in ("b'", 'b"')
        if bare and m.group(3) == ":" and not _at_key_place(text, m.start()):
            continue  # prose: "the token from $HF_TOKEN: ...", "USER=SECRET:SCOPE"
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
    if "@" in text and "://" in text:  # a URL's userinfo, and wherever the text repeats it
        met = [s for u in _USERINFO.findall(text) for s in _userinfo_secrets(u) if len(s) >= _MIN_SECRET]
        if met:
            remember(*met)
            known = tuple(sorted({*known, *met}, key=len, reverse=True))
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
    """Return the plain secret, for handing to a client library only; it is masked in every later
    output of this process (:func:`remember`)."""
    if value is None:
        return None
    if _is_secret_type(value):
        plain = value.get_secret_value()  # type: ignore[union-attr]
        remember(plain)
        return plain  # type: ignore[no-any-return]
    remember(value)
    return value


def redact(value: T, *secrets: Any) -> T:
    """``value`` with every secret masked (see the module docstring): text, or a copy of a mapping
    or sequence. ``secrets`` (strings or SecretStrs) are masked too, wherever they appear."""
    known = [p for s in secrets if isinstance(p := (s.get_secret_value() if _is_secret_type(s) else s), str)
             and len(p) >= 4]  # given by the caller: masked from 4 characters
    with _remembered_lock:
        met = list(_remembered)
    return _redact(value, tuple(sorted({*known, *met, *_process_secrets()}, key=len, reverse=True)))


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


__all__ = ["MASK", "install_log_redaction", "looks_secret", "redact", "remember", "reveal", "secrets_in_env"]
