"""A stand-in for neuronx-cc that writes Neuron-style cache entries and counts compilations.

It behaves like the real compiler's cache, as far as a cache can see: a graph's entry lives at
``neuronxcc-<version>/MODULE_<hlo hash>+<flags hash>/``; a good entry (``model.neff`` +
``model.done``) is reused; a failed one (``model.log`` without ``model.neff``) makes the compile
fail without retrying; a held ``*.lock`` blocks (here: raises instead of waiting forever).
Used by kvbucket's tests, and by users' tests of their compile-cache integration on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_VERSION = "2.15.128.0+56dc5a86"


class CompileFailed(RuntimeError):
    """The stand-in compile failed, or a cached failure blocks it (as neuronx-cc does)."""


class CompileBlocked(RuntimeError):
    """A lock held on the entry would make the real compiler wait forever."""


@dataclass
class StandInCompiler:
    cache_dir: Path
    version: str = DEFAULT_VERSION
    neff_size: int = 4096
    compilations: int = 0
    cache_hits: int = 0

    def module_dir(self, graph: str, flags: str = "--O2") -> Path:
        hlo = hashlib.sha256(graph.encode()).hexdigest()[:20]
        fh = hashlib.sha256(flags.encode()).hexdigest()[:8]
        return Path(self.cache_dir) / f"neuronxcc-{self.version}" / f"MODULE_{hlo}+{fh}"

    def compile(self, graph: str, flags: str = "--O2", *, fail: bool = False, crash: bool = False) -> bytes:
        """Return the NEFF for ``graph``, from the cache when good there, else by "compiling"."""
        d = self.module_dir(graph, flags)
        names = {p.name for p in d.iterdir()} if d.is_dir() else set()
        if any(n.endswith(".lock") for n in names):
            raise CompileBlocked(f"{d} is locked by another (or a dead) compile")
        if "model.neff" in names and "model.done" in names:
            self.cache_hits += 1
            return (d / "model.neff").read_bytes()
        if "model.log" in names and "model.neff" not in names:
            raise CompileFailed(f"{d} holds a failed compile (model.log)")
        d.mkdir(parents=True, exist_ok=True)
        lock = d / "model.hlo_module.pb.lock"
        lock.write_bytes(b"")
        (d / "model.hlo_module.pb").write_bytes(graph.encode())
        (d / "compile_flags.json").write_text(json.dumps([flags]))
        self.compilations += 1
        if crash:
            return b""  # the process "died": lock and partial entry stay behind
        if fail:
            (d / "model.log").write_text(f"ERROR: compilation of {graph!r} failed\n")
            lock.unlink()
            raise CompileFailed(f"compilation of {graph!r} failed")
        neff = (hashlib.sha256(graph.encode() + flags.encode()).digest() * (self.neff_size // 32 + 1))
        neff = neff[: self.neff_size]
        (d / "model.neff").write_bytes(neff)
        (d / "model.done").write_bytes(b"")
        os.unlink(lock)
        return neff


__all__ = ["DEFAULT_VERSION", "CompileBlocked", "CompileFailed", "StandInCompiler"]
