"""``kvbucket demo --config FILE`` applies the ``KVBUCKET_*`` variables an engine applies (issue 40).

An outside check: the synthetic demo with ``--config`` refused a bad ``KVBUCKET_REMOTE_URL`` (it
checked the environment) but then used the file's remote_url anyway (it read the file with an
empty environment). The demo reads its config with ``load_engine_config``, environment included."""

from __future__ import annotations

from pathlib import Path

from cli_run import run_cli


def _chunks(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_demo_config_takes_the_remote_url_from_the_environment(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    in_file, in_env = tmp_path / "from-file", tmp_path / "from-env"
    config = tmp_path / "engine.yaml"
    config.write_text(f"chunk_size: 256\nremote_url: file://{in_file}\n")
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--config", str(config),
                "--keep", env={**cli_env, "KVBUCKET_REMOTE_URL": f"file://{in_env}"})
    assert r.code == 0, (r.out, r.err)
    assert f"remote (file://{in_env})" in " ".join(r.out.split()), r.out
    assert len(_chunks(in_env)) >= 2 and not _chunks(in_file), (_chunks(in_env), _chunks(in_file))


def test_demo_config_without_the_variable_uses_the_files_remote(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    in_file = tmp_path / "from-file"
    config = tmp_path / "engine.yaml"
    config.write_text(f"chunk_size: 256\nremote_url: file://{in_file}\n")
    r = run_cli("demo", "--synthetic", "--chunks", "2", "--model", "qwen2.5-0.5b", "--config", str(config),
                "--keep", env=cli_env)
    assert r.code == 0, (r.out, r.err)
    assert len(_chunks(in_file)) >= 2
