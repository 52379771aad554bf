"""Redaction by value and structure, not by words (issue 29 items 5 and 6).

Each kind of secret is planted (a Hub token, an AWS secret key, a JSON keyring's key, a keyring
file's key, Hub emulator tokens, URL userinfo, a presigned URL's signature) and the installed
``kvbucket`` script is run as a user would: no secret may show, and what is no secret must come
through unchanged: the working directory's path (``$PWD`` was taken for a secret: every path
under it printed as ``***``), a bucket name, and a message's own words ("the token from
$HF_TOKEN: ...", "USER=SECRET:SCOPE"). The process-wide log filter changes another library's
message only where such a value appears.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

from kvbucket.secrets import MASK, redact


def _key() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


@pytest.fixture
def planted(tmp_path: Path, cli_env: dict[str, str]) -> tuple[dict[str, str], dict[str, str], Path]:
    """(label -> secret value, the environment holding them, a working directory)."""
    work = tmp_path / "work dir"  # a space too: paths are printed as they are
    work.mkdir()
    values = {
        "HF_TOKEN": f"hf_{secrets.token_hex(16)}", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "keyring key": _key(), "emulator token": f"emu{secrets.token_hex(6)}",
    }
    short = "SECRET"  # the issue's own example: short, and a word (not searched for: names hold it)
    env = {
        **cli_env, "PWD": str(work), "HF_HOME": str(work / "hf-home"), "COLUMNS": "200",
        "HF_TOKEN": values["HF_TOKEN"], "AWS_SECRET_ACCESS_KEY": values["AWS_SECRET_ACCESS_KEY"],
        "AWS_ACCESS_KEY_ID": "AKIAPLANTEDEXAMPLE",
        "KVBUCKET_KEYRING": json.dumps({"tenants": {"t": {"1": values["keyring key"]}}}),
        "KVBUCKET_EMULATOR_TOKENS": f"alice={values['emulator token']}:write bob={short}:read",
    }
    return values, env, work


def _leaked(values: dict[str, str], text: str) -> list[str]:
    return [label for label, v in values.items() if v in text]


def test_doctor_shows_emulator_users_and_paths_never_tokens(planted: Any) -> None:
    """Item 5: doctor printed ``alice=SECRET:***`` (the scope masked, the token shown); item 6:
    its config paths under the working directory printed as ``***``."""
    values, env, work = planted
    r = run_cli("doctor", "--timeout", "2", env=env, cwd=work)
    assert not _leaked(values, r.out + r.err), r.out
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in r.out.splitlines() if ln.startswith("  ") and
            len(ln.split()) > 1}
    assert rows["KVBUCKET_EMULATOR_TOKENS"] == f"alice={MASK}:write bob={MASK}:read", r.out
    assert f"({work / 'hf-home' / 'token'} does not exist)" in r.out, r.out  # the path, unchanged


@pytest.mark.parametrize(("url", "secret", "kept"), [
    ("s3://AKIAEXAMPLE7:s3cr3tPassw0rd@my-kv-bucket/x", "s3cr3tPassw0rd", "@my-kv-bucket"),
    ("hf://tok_pl4nted0123@buckets/acme/kv-bucket", "tok_pl4nted0123", "@buckets/acme/kv-bucket"),
])
def test_url_userinfo_is_masked_everywhere_the_message_repeats_it(
    cli_env: dict[str, str], tmp_path: Path, url: str, secret: str, kept: str
) -> None:
    """Item 5: ``kvbucket ls s3://AKIA:SECRET@bucket/x`` echoed 'AKIA:SECRET@bucket' (the bucket
    part, outside the URL), and the hf:// hint "did you mean hf://buckets/TOKEN@...". The bucket
    name still shows, unchanged."""
    for args in (["ls", url], ["--debug", "ls", url]):
        r = run_cli(*args, env=cli_env, cwd=tmp_path)
        out = r.out + r.err
        assert r.code == 2 and secret not in out, out
        assert f"{MASK}{kept}" in out, out


def test_paths_under_the_working_directory_and_the_errors_words_are_shown(planted: Any) -> None:
    """Item 6: ``store directory '***/nope' does not exist``: $PWD's value was a secret."""
    values, env, work = planted
    for args in (["ls", "./nope"], ["--debug", "ls", "./nope"], ["ls", str(work / "nope")]):
        r = run_cli(*args, env=env, cwd=work)
        assert r.code == 2 and not _leaked(values, r.out + r.err), r.err
        assert f"store directory '{work / 'nope'}' does not exist" in r.err, r.err


def test_a_keyring_files_keys_are_masked_once_loaded(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A key read from a keyring file (not in the environment) is masked wherever it shows later."""
    from kvbucket.encryption import Keyring

    key = _key()
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"t": {"1": key}}}))
    Keyring.from_file(path)
    caplog.set_level(logging.INFO)
    logging.getLogger("somelib").info("loaded %s from %s", key, path)
    assert caplog.records[-1].getMessage() == f"loaded {MASK} from {path}"


def test_other_libraries_messages_change_only_where_a_secret_is(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The filter is process-wide (LMCache's tracebacks, httpx's request lines): words and paths
    pass as they are; only values of secrets and credential shapes are replaced."""
    caplog.set_level(logging.INFO)
    lib = logging.getLogger("lmcache.v1.storage_backend")
    plain = [
        f"cannot open {tmp_path}/pwd/keys/private: no such file",
        "check the token from $HF_TOKEN: the bucket must exist",
        "a token is given as USER=SECRET:SCOPE, SCOPE being read, write or fine-read",
        "the password policy says: rotate keys monthly (auth: sso)",
        "num_tokens=256 chunk_tokens: 16 max_keys=3",
    ]
    for msg in plain:
        lib.warning("%s", msg)
        assert caplog.records[-1].getMessage() == msg
    sig = "0" * 24 + secrets.token_hex(20)
    presigned = (f"GET https://b.s3.amazonaws.com/kv/x?X-Amz-Credential=AKIAEXAMPLE%2F2026&"
                 f"X-Amz-Signature={sig}&X-Amz-Expires=60 for {tmp_path}/out")
    lib.warning("%s", presigned)
    got = caplog.records[-1].getMessage()
    assert sig not in got and "X-Amz-Signature=***" in got and got.endswith(f" for {tmp_path}/out"), got


def test_engine_store_urls_with_userinfo_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's and vLLM's ``store_url`` go through ``open_store``: its error and a log of it
    repeat no userinfo."""
    from kvbucket.errors import ConfigError
    from kvbucket.integrations.sglang import SGLangStorageSettings
    from kvbucket.integrations.vllm import VLLMTierSettings
    from kvbucket.stores import open_store

    for settings in (SGLangStorageSettings.from_extra_config({"store_url": "s3://AKIAX1:eng1neSecret@b_ad/x"}),
                     VLLMTierSettings.from_tier_config({"store_url": "hf://engineTok3n99@buckets/a/b"})):
        with pytest.raises(ConfigError) as info:
            open_store(settings.store_url)
        logging.getLogger("sglang.srt").error("storage backend failed: %s", info.value)
        for text in (str(info.value), repr(info.value.args), caplog.records[-1].getMessage()):
            assert "eng1neSecret" not in redact(text) and "engineTok3n99" not in redact(text)
        assert "eng1neSecret" not in str(info.value) and "engineTok3n99" not in str(info.value)
        assert "eng1neSecret" not in caplog.text and "engineTok3n99" not in caplog.text
