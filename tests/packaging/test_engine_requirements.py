"""The engine venvs install kvbucket's dependencies from its own metadata (issue 40 item 7).

``engines/venv.sh ENGINE --requirements`` prints what the script installs (nothing is built or
downloaded): the engine's own import list plus pyproject.toml's ``[project].dependencies`` and
the ``encryption`` extra, read from the file itself (a dependency added to a copy of
pyproject.toml shows up). Every one of kvbucket's dependencies is pinned in
``constraints-ENGINE.txt`` at a version kvbucket allows, so the venv resolves to what a user's
``pip install kvbucket`` next to the engine would get. The built venvs are checked by the script
itself before it stamps them and by tests/engines (the compiled Xet decoder runs there).
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("sglang", "vllm")


def kvbucket_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["encryption"])


def script_requirements(root: Path, engine: str) -> list[str]:
    p = subprocess.run(["bash", str(root / "engines" / "venv.sh"), engine, "--requirements"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def pins(engine: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / f"constraints-{engine}.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_the_venv_script_installs_kvbuckets_dependencies_from_its_metadata(engine: str,
                                                                            tmp_path: Path) -> None:
    listed = script_requirements(ROOT, engine)
    assert set(kvbucket_requirements()) <= set(listed)
    # a dependency added to pyproject.toml is installed with no other edit
    for name in ("engines", f"constraints-{engine}.txt"):
        (shutil.copytree if name == "engines" else shutil.copy)(ROOT / name, tmp_path / name)
    text = (ROOT / "pyproject.toml").read_text()
    text = text.replace("dependencies = [\n", 'dependencies = [\n  "zzz-new-dependency>=1",\n', 1)
    (tmp_path / "pyproject.toml").write_text(text)
    assert "zzz-new-dependency>=1" in script_requirements(tmp_path, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_kvbucket_dependency_is_pinned_for_the_engine_at_a_version_kvbucket_allows(engine: str) -> None:
    pinned = pins(engine)
    wrong = []
    for line in kvbucket_requirements():
        r = Requirement(line)
        version = pinned.get(canonicalize_name(r.name))
        if version is None or not r.specifier.contains(version, prereleases=True):
            wrong.append(f"{r.name}: {version or 'not pinned'} (kvbucket needs {r.specifier})")
    assert not wrong, f"constraints-{engine}.txt: " + "; ".join(wrong)
