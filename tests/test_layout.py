"""The house rules of src/kvbucket, checked on every run: no import circle, no file past 600 lines.

The import graph is read with :mod:`ast`, the way an import linter reads it, and counts more than
what runs at import time: every ``import`` and ``from ... import`` anywhere in a module (at module
level, inside functions, under ``if TYPE_CHECKING:``), ``importlib.import_module("kvbucket...")``
with a literal name, and the ``"kvbucket.module:attr"`` factory strings of the lazy registries
(store openers, remote plugins). ``from a.b import c`` is an edge to the module ``a.b.c`` when
that is a module, else to ``a.b``. A package's ``__init__`` is a module like any other: its
re-exports are edges from it to the submodules, and importing ``a.b.c`` is an edge to ``a.b.c``
only, not to ``a`` or ``a.b`` (Python runs their ``__init__`` first, but a re-export the package
makes is not a dependency of the module that asked for ``a.b.c``). So a submodule that imports its
own package's ``__init__`` (``from kvbucket.l2 import X`` inside ``kvbucket.l2.adapter``) is a
circle, as it is at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvbucket"
MAX_LINES = 600
_FACTORY = re.compile(r"^kvbucket(\.\w+)+:\w+$")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ``mods`` that ``name`` (a module or ``module.attr``) resolves to."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, mods: dict[str, Path], *, at_import: bool = False) -> set[str]:
    """The modules of ``mods`` that ``module`` imports; with ``at_import``, only those Python
    imports while running it (module and class bodies, not functions nor ``if TYPE_CHECKING:``),
    plus the ``__init__`` of each package it enters that is not one of its own."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    nodes = _run_at_import(tree.body) if at_import else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _FACTORY.match(node.value):
            names = [node.value.partition(":")[0]]
        for name in names:
            if name.split(".")[0] == PACKAGE:
                target = _target(name, mods)
                if target is not None and target != module:
                    found.add(target)
    if at_import:
        own = _ancestors(module) | {module}
        found |= {p for t in found for p in _ancestors(t) if p in mods and p not in own}
    return found


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _run_at_import(stmts: list[ast.stmt]) -> list[ast.AST]:
    """The import statements Python runs when it runs ``stmts`` (a module body)."""
    out: list[ast.AST] = []
    for node in stmts:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.extend(_run_at_import(node.orelse))
        else:  # class bodies, try/except, with, if, for, while, match: all run
            for field in ("body", "orelse", "finalbody"):
                out.extend(_run_at_import(getattr(node, field, None) or []))
            for part in [*(getattr(node, "handlers", None) or []), *(getattr(node, "cases", None) or [])]:
                out.extend(_run_at_import(part.body))
    return out


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~200)
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def long_files() -> dict[str, int]:
    return {
        str(p.relative_to(SRC)): n
        for p in sorted((SRC / PACKAGE).rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }


def test_no_import_circle_in_src() -> None:
    found = circles(import_graph())
    assert not found, "import circles in src/kvbucket (each line one circle):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_import_circle_at_import_time() -> None:
    """What runs at import, package __init__ files included, has no circle (a circle there is a
    'partially initialized module' error for whoever imports the wrong module first)."""
    mods = modules()
    found = circles({m: imports_of(m, p, mods, at_import=True) for m, p in mods.items()})
    assert not found, "import-time circles in src/kvbucket (package __init__ files included):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_source_file_past_600_lines() -> None:
    assert not long_files(), f"files in src/ past {MAX_LINES} lines: {long_files()}"


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader counts imports inside functions, under TYPE_CHECKING, relative ones, lazy
    ``import_module`` calls and factory strings, and finds the circle they make; at import time
    it counts only what runs, and the package __init__ files that run first."""
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from kvbucket import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import X\n",
        "sub/__init__.py": "",
        "sub/c.py": "import importlib\nimportlib.import_module('kvbucket.d')\n",
        "d.py": "OPENERS = {'x': 'kvbucket.a:f'}\nLOG = 'kvbucket.e'\n",
        "e.py": "from kvbucket.sub import c\n",
        # an import-time circle through a package __init__ only: f -> pkg (runs first) -> pkg.inner -> f
        "pkg/__init__.py": "from kvbucket.pkg.inner import X\n",
        "pkg/inner.py": "try:\n    from kvbucket.f import Y\nexcept ImportError:\n    pass\nX = 1\n",
        "pkg/base.py": "",
        "f.py": "class K:\n    from kvbucket.pkg.base import __name__ as Z\nY = 1\n",
    }
    for name, text in files.items():
        (tmp_path / PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / name).write_text(text)
    mods = {}
    for path in sorted((tmp_path / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert graph["kvbucket.d"] == {"kvbucket.a"}  # a logger-like name is not an import
    assert graph["kvbucket.e"] == {"kvbucket.sub.c"}
    assert graph["kvbucket.f"] == {"kvbucket.pkg.base"}
    assert circles(graph) == [["kvbucket.a", "kvbucket.b", "kvbucket.d", "kvbucket.sub.c"]]
    at_import = {m: imports_of(m, p, mods, at_import=True) for m, p in mods.items()}
    assert at_import["kvbucket.a"] == set() and at_import["kvbucket.b"] == set()
    assert at_import["kvbucket.f"] == {"kvbucket.pkg", "kvbucket.pkg.base"}
    assert at_import["kvbucket.pkg.inner"] == {"kvbucket.f"}  # its own package is not an edge
    assert circles(at_import) == [["kvbucket.f", "kvbucket.pkg", "kvbucket.pkg.inner"]]


_FAMILIES = ("kvbucket.stores.hub", "kvbucket.stores.s3", "kvbucket.stores.local")


def _room(module: str) -> str:
    """The room of stores/ a module lives in: a family, ``guard``, or the floor itself."""
    for room in (*_FAMILIES, "kvbucket.stores.guard"):
        if module == room or module.startswith(room + "."):
            return room
    return module


def test_stores_rooms_import_downwards_only() -> None:
    """stores/'s layout (docs/architecture.md): ``guard`` imports no store family, ``base`` imports
    nothing of stores/ but ``deadline`` and ``buffers`` (its read and write buffers, split from it),
    and a family imports no other family. (``kvbucket.stores``
    itself opens every family by name, lazily.)"""
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        room = _room(module)
        for target in targets:
            troom = _room(target)
            if room == "kvbucket.stores.guard" and troom in _FAMILIES:
                wrong.append(f"{module} -> {target} (guard/ imports a store family)")
            elif room in _FAMILIES and troom in _FAMILIES and troom != room:
                wrong.append(f"{module} -> {target} (one family imports another)")
            elif module == "kvbucket.stores.base" and target.startswith("kvbucket.stores") and (
                target not in ("kvbucket.stores.deadline", "kvbucket.stores.buffers")
            ):
                wrong.append(f"{module} -> {target} (base imports above it)")
    assert not wrong, "\n".join(wrong)
    assert {"kvbucket.stores.hub.store", "kvbucket.stores.guard.sealed", "kvbucket.stores.s3.store",
            "kvbucket.stores.local.file"} <= set(graph)


def test_store_classes_import_from_kvbucket_stores_without_loading_every_client() -> None:
    """The public path (``from kvbucket.stores import S3Store``) and the old ``kvbucket.stores.s3``
    name resolve, each family's client loads only when its class is first asked for."""
    import subprocess
    import sys

    code = """
import sys
import kvbucket.stores as s
heavy = ("huggingface_hub", "hf_xet", "obstore", "pycurl", "numba")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
from kvbucket.stores import *
from kvbucket.stores.s3 import S3Config
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
from kvbucket.stores import FileStore, HFBucketConfig, HFBucketStore, S3Store, SealedStore, seal_store
from kvbucket.stores.s3 import S3Store as Old
from kvbucket.stores.s3.store import S3Store as New
from kvbucket.stores.local.file import FileStore as F
assert Old is New is S3Store and F is FileStore
assert {"S3Store", "HFBucketStore", "SealedStore"} <= set(dir(s))
try:
    s.NoSuchStore
except AttributeError as e:
    assert "NoSuchStore" in str(e)
else:
    raise SystemExit("no AttributeError")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
