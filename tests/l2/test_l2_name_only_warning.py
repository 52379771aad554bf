"""Issue 38: the name-only warning names the exact setting of its path (spelled where the user
sets it) and what setting it does to the chunks stored so far: LMCache's MP L2 adapter (built by
LMCache's factory), the non-MP connector (LMCache's engine config) and the library's remote tier
as the engine YAML builds it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="the lmcache extra is not installed (pip install kvbucket[lmcache])")

from kvbucket.identity import core

pytestmark = pytest.mark.lmcache


def said(caplog: pytest.LogCaptureFixture, where: str) -> str:
    found = [r.getMessage() for r in caplog.records if r.getMessage().startswith(where) and "name only" in
             r.getMessage()]
    assert len(found) == 1, [r.getMessage() for r in caplog.records]
    return found[0]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "_warned", set())  # once per process: each test sees its own


def test_the_mp_adapter_names_adapter_params(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from test_l2_identity import mp_adapter

    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        mp_adapter(tmp_path / "kv").close()
    text = said(caplog, "kvbucket L2 adapter")
    assert "Set adapter_params.model_identity (" in text
    assert "stored so far by name only are misses until adapter_params.accept_name_only is also set" in text


def test_the_connector_names_its_plugin_keys(tmp_path: Path, lm_loop: object,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from test_l2_identity import connector, run

    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"):
        conn = connector(lm_loop, tmp_path / "kv")
        run(lm_loop, conn.close())
    text = said(caplog, "kvbucket connector 'kv'")
    assert "Set remote_storage_plugin.kv.model_identity (LMCache's extra_config) (" in text
    assert "until remote_storage_plugin.kv.accept_name_only is also set" in text


def test_the_engine_yaml_remote_tier_names_extra_config(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from kvbucket.chunks import KVLayout
    from kvbucket.config import EngineConfig, build_backend
    from kvbucket.testing.backend_tests import chunk_bytes, key

    layout = KVLayout(2, 2, 16, "bfloat16", chunk_tokens=16)
    config = EngineConfig(local_cpu=False, remote_url=str(tmp_path / "kv"), chunk_size=16)
    with caplog.at_level(logging.WARNING, logger="kvbucket.identity"), build_backend(config, layout) as tier:
        tier.put(key(0), chunk_bytes(layout, 0))
    text = said(caplog, "kvbucket remote tier")
    assert "Set extra_config.model_identity (RemoteBackend(model_identity=) in code) (" in text
    assert "misses for good (`kvbucket rm URL --model NAME --identity none` removes them)" in text
