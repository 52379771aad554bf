"""Code blocks of README.md and docs/*.md, and the commands in them (used by test_docs_blocks.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
#: first words that mark a line of an unlabelled block as a command rather than output
KNOWN_COMMANDS = {"kvbucket", "python", "python3", "make", "pip", "lmcache", "vllm", "export", "pytest"}


_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    #: the ``<!-- doc-test: ... -->`` comment on the line before the fence: ``syntax-only: why``
    #: (checked, not run: a GPU, an engine, a model download, a pytest fixture), ``file NAME`` (a
    #: data block written as NAME next to the doc's blocks when they run), or a test that runs it
    mark: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md (new docs are picked up by this glob)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            indent, fence, lang = m.groups()
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            prev = lines[start - 1] if start > 0 else ""
            mark = m2.group(1) if (m2 := _MARK.match(prev)) else ""
            out.append(Block(path, start + 1, lang.lower(), "\n".join(body), mark))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in blocks(f)]


def _join_continued(lines: list[str]) -> list[str]:
    """Lines joined where a backslash or an open quote carries a command over to the next line."""
    out: list[str] = []
    buf = ""
    for line in lines:
        buf = f"{buf}\n{line}" if buf else line
        if buf.rstrip().endswith("\\"):
            buf = buf.rstrip()[:-1]
            continue
        try:
            shlex.split(buf, comments=True)
        except ValueError:  # an open quote: a JSON argument spread over lines
            continue
        out.append(buf)
        buf = ""
    if buf:
        out.append(buf)
    return out


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def strip_env(argv: list[str]) -> list[str]:
    """``A=1 B=2 cmd args`` -> ``cmd args``."""
    i = 0
    while i < len(argv) and _ASSIGN.match(argv[i]):
        i += 1
    return argv[i:]


def commands(block: Block) -> list[str]:
    """The command lines of a block.

    Shell blocks: lines after a ``$ `` prompt if the block has prompts (the rest is output),
    else every line. ``text`` blocks are output (only ``$ `` lines are commands); unlabelled
    blocks are output or diagrams, except ``$ `` lines and lines that start with a known command.
    """
    lines = block.text.splitlines()
    prompted = any(ln.startswith("$ ") for ln in lines)
    if prompted:
        groups: list[list[str]] = []
        taking = False
        for ln in lines:
            if ln.startswith("$ "):
                groups.append([ln[2:]])
                taking = True
            elif taking and groups and _incomplete("\n".join(groups[-1])):
                groups[-1].append(ln)  # a continuation of the prompted command
            else:
                taking = False  # output
        return [c for g in groups for c in _join_continued(g) if words(c)]
    if block.lang in SHELL_LANGS:
        return [c for c in _join_continued(lines) if words_or_raw(c)]
    if block.lang == "":
        first = next((ln for ln in lines if ln.strip()), "")
        if not _starts_with_command(first):
            return []  # output or a diagram
        out = []
        for c in _join_continued(lines):
            if _starts_with_command(c):
                out.append(c)
        return out
    return []


def _starts_with_command(line: str) -> bool:
    try:
        argv = strip_env(words(line))
    except ValueError:
        argv = strip_env(line.split())
    return bool(argv) and Path(argv[0]).name in KNOWN_COMMANDS


def words_or_raw(c: str) -> bool:
    try:
        return bool(words(c))
    except ValueError:
        return bool(c.strip())


def _incomplete(text: str) -> bool:
    """A command line that goes on: a trailing backslash or an open quote."""
    if text.rstrip().endswith("\\"):
        return True
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False
