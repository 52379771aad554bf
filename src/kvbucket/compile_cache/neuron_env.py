"""Where the Neuron compiler keeps its cache, which compiler is installed, and whether one runs."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DEFAULT_NEURON_CACHE_DIR = "/var/tmp/neuron-compile-cache"
COMPILER_PROCESS = "neuronx-cc"


@dataclass(frozen=True, slots=True)
class NeuronCacheLocation:
    """The local cache dir, a remote cache URL Neuron was pointed at (``s3://``), and whether on."""

    local_dir: Path
    remote_url: str | None = None
    disabled: bool = False


def _flag_value(flags: list[str], name: str) -> str | None:
    value = None
    for i, f in enumerate(flags):
        if f.startswith(name + "="):
            value = f.split("=", 1)[1]
        elif f == name and i + 1 < len(flags):
            value = flags[i + 1]
    return value


def resolve_neuron_cache(cache_dir: str | os.PathLike[str] | None = None,
                         env: Mapping[str, str] | None = None) -> NeuronCacheLocation:
    """Resolve the cache as the Neuron tools do.

    Order: explicit ``cache_dir``; ``NEURON_COMPILE_CACHE_URL`` unless it is an ``s3://`` URL
    (then it names a remote cache: returned as ``remote_url``, never turned into a path);
    ``--cache_dir=`` in ``NEURON_CC_FLAGS``; ``/var/tmp/neuron-compile-cache``. ``--no-cache`` in
    ``NEURON_CC_FLAGS`` disables caching altogether.
    """
    env = os.environ if env is None else env
    try:
        flags = shlex.split(env.get("NEURON_CC_FLAGS", ""))
    except ValueError:
        flags = env.get("NEURON_CC_FLAGS", "").split()
    disabled = "--no-cache" in flags
    url = (env.get("NEURON_COMPILE_CACHE_URL") or "").strip() or None
    remote = url if url and url.startswith("s3://") else None
    if cache_dir is not None:
        local = Path(cache_dir)
    elif url and not remote:
        local = Path(url.removeprefix("file://"))
    elif (flag_dir := _flag_value(flags, "--cache_dir")) is not None:
        local = Path(flag_dir)
    else:
        local = Path(DEFAULT_NEURON_CACHE_DIR)
    return NeuronCacheLocation(local.expanduser(), remote, disabled)


def installed_compiler_version() -> str | None:
    """The installed ``neuronx-cc`` version (e.g. ``2.15.128.0+56dc5a86``), or None."""
    for dist in ("neuronx-cc", "neuronxcc"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def running_compilers(proc: Path = Path("/proc")) -> list[int]:
    """PIDs of running ``neuronx-cc`` processes (any argv element whose basename starts with it)."""
    pids: list[int] = []
    me = os.getpid()
    try:
        candidates = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return pids
    for p in candidates:
        pid = int(p.name)
        if pid == me:
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited, or not ours to read
        if any(os.path.basename(a.decode(errors="replace")).startswith(COMPILER_PROCESS) for a in argv if a):
            pids.append(pid)
    return pids


__all__ = [
    "DEFAULT_NEURON_CACHE_DIR",
    "NeuronCacheLocation",
    "installed_compiler_version",
    "resolve_neuron_cache",
    "running_compilers",
]
