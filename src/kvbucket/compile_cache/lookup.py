"""Export records: which configurations of a model are compiled in a bucket, found by any front end.

A record is the flat config dict a front end exported with (tensor parallel degree, dtype, batch
size, sequence length, ...). Front ends name the same setting differently (optimum-neuron's
``tp_degree`` is vLLM's ``tensor_parallel_size``; ``torch_dtype="bfloat16"`` is ``dtype="bf16"``),
so records are stored and compared in a *normalized* form: canonical key names and values.

Records live model-first, at ``.kvbucket/exports/<org>/<model>/<task>/<group>/<config id>.json``,
so ``lookup MODEL_ID`` needs one listing whatever the compiler version. The config id is a
content address (sha256 of the normalized config as sorted compact JSON), so the same config
exported twice, by any front end, is one record.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbucket.errors import ConfigError
from kvbucket.stores.base import ObjectStore

EXPORTS_PREFIX = ".kvbucket/exports/"
DEFAULT_TASK = "default"
ANY_CONFIG = "any"

# canonical name <- aliases (compared after lower-casing and '-' -> '_')
_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("tp_degree", "tp_size", "tp", "tensor_parallel_degree", "num_cores"),
    "pipeline_parallel_size": ("pp_degree", "pp_size", "pp"),
    "dtype": ("torch_dtype", "auto_cast_type", "precision"),
    "batch_size": ("max_batch_size", "max_num_seqs", "batch"),
    "sequence_length": ("max_model_len", "max_seq_len", "seq_len", "max_sequence_length", "n_positions",
                        "max_context_length"),
    "instance_type": ("target", "instance"),
    "compiler_version": ("neuronxcc_version", "compiler"),
}
KEY_ALIASES: dict[str, str] = {a: canon for canon, aliases in _KEY_ALIASES.items() for a in aliases}

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "f32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
    "fp8": "float8_e4m3fn", "f8e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2",
    "int8": "int8", "s8": "int8",
}

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def normalize_key(key: str) -> str:
    k = str(key).strip().lower().replace("-", "_").lstrip("_")
    return KEY_ALIASES.get(k, k)


def _parse_scalar(value: str) -> Any:
    v = value.strip()
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def normalize_value(key: str, value: Any) -> Any:
    """Canonical value: dtype spellings unified, numeric strings parsed, strings lower-cased."""
    if isinstance(value, str):
        value = _parse_scalar(value)
    if isinstance(value, str):
        s = value.strip().lower().removeprefix("torch.")
        if key == "dtype":
            return _DTYPE_ALIASES.get(s, s)
        return s
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def normalize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A flat config with canonical key names and values. Nested values are refused (say which)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"export_config must be a dict of settings, got {type(config).__name__}")
    out: dict[str, Any] = {}
    for k, v in config.items():
        if not isinstance(v, str | int | float | bool) and v is not None:
            raise ConfigError(
                f"export_config[{k!r}] is a {type(v).__name__}; records are flat dicts of scalars "
                "(str, int, float, bool, None), so flatten it first (e.g. 'neuron.tp_degree': 2)"
            )
        nk = normalize_key(k)
        nv = normalize_value(nk, v)
        if nk in out and out[nk] != nv:
            raise ConfigError(f"export_config sets {nk!r} twice with different values "
                              f"({out[nk]!r} and {nv!r}) through aliases; keep one of them")
        out[nk] = nv
    return dict(sorted(out.items()))


def config_id(config: Mapping[str, Any] | None) -> str:
    """Content address of a config (16 hex digits of sha256 over sorted compact JSON)."""
    if not config:
        return ANY_CONFIG
    canon = json.dumps(normalize_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def model_path(model_id: str) -> str:
    """``org/name`` for a Hub model id (``name`` alone becomes ``_/name``: no org is ever named ``_``).

    Local paths and ids with '..' or odd characters are refused: they would not name the same
    model on another machine, and must never climb out of the bucket's per-model area.
    """
    if not isinstance(model_id, str) or not model_id.strip():
        raise ConfigError("model_id must be a non-empty Hub model id such as meta-llama/Llama-3.1-8B")
    parts = model_id.strip().split("/")
    if len(parts) == 1:
        parts = ["_", parts[0]]
    valid = (len(parts) == 2 and (parts[0] == "_" or _SEGMENT_RE.match(parts[0]))
             and _SEGMENT_RE.match(parts[1]))
    if not valid:
        raise ConfigError(
            f"model_id {model_id!r} is not a Hub model id (org/name of letters, digits, '.', '_', '-'); "
            "for a local checkout pass the Hub id it came from, or omit model_id to use only the flat area"
        )
    if parts[0].startswith("MODULE_"):
        raise ConfigError(f"model_id {model_id!r}: an org named MODULE_* would collide with Neuron entries")
    return "/".join(parts)


def task_segment(task: str | None) -> str:
    if task is None or task == "":
        return DEFAULT_TASK
    if not _SEGMENT_RE.match(task):
        raise ConfigError(
            f"task {task!r} must be one word of letters, digits, '.', '_', '-' (e.g. text-generation)")
    return task


def record_name(model_id: str, task: str | None, group: str, config: Mapping[str, Any]) -> str:
    return f"{EXPORTS_PREFIX}{model_path(model_id)}/{task_segment(task)}/{group}/{config_id(config)}.json"


def make_record(model_id: str, task: str | None, group: str, layout: str, config: Mapping[str, Any]) -> bytes:
    """The record's bytes: deterministic for a (model, task, group, normalized config)."""
    body = {
        "format": 1,
        "model_id": model_id,
        "task": task_segment(task),
        "group": group,
        "layout": layout,
        "config": normalize_config(config),
    }
    return json.dumps(body, sort_keys=True, indent=1).encode()


@dataclass(frozen=True, slots=True)
class ExportRecord:
    name: str
    model_id: str
    task: str
    group: str
    layout: str
    config: dict[str, Any]

    def matches(self, filters: Mapping[str, Any]) -> bool:
        want = normalize_config(filters)
        return all(k in self.config and self.config[k] == v for k, v in want.items())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model_id": self.model_id, "task": self.task, "group": self.group,
                "layout": self.layout, "config": self.config}


def lookup(store: ObjectStore, model_id: str, *, task: str | None = None, group: str | None = None,
           filters: Mapping[str, Any] | None = None) -> list[ExportRecord]:
    """Records of a model matching ``filters`` (normalized names and values), newest groups first.

    One listing (a request per 1,000 names) and one batched read of the records. Records that
    cannot be read or parsed are skipped and do not count as matches.
    """
    prefix = f"{EXPORTS_PREFIX}{model_path(model_id)}/"
    if task:
        prefix += f"{task_segment(task)}/"
        if group:
            prefix += f"{group}/"
    names = [o.name for o in store.list(prefix) if o.name.endswith(".json")]
    if group:
        names = [n for n in names if n.split("/")[-2] == group]
    if not names:
        return []
    out: list[ExportRecord] = []
    for r in store.get_many(names):
        if not r.found or r.data is None:
            continue
        try:
            body = json.loads(bytes(r.data))
            rec = ExportRecord(r.name, body["model_id"], body["task"], body["group"], body.get("layout", ""),
                               dict(body["config"]))
        except (ValueError, KeyError, TypeError):
            continue
        if rec.matches(filters or {}):
            out.append(rec)
    out.sort(key=lambda x: (x.group, x.task, x.name), reverse=True)
    return out


def parse_filter_args(args: Iterable[str]) -> dict[str, str]:
    """``["--tensor_parallel_size", "2", "--dtype=bf16"]`` -> ``{"tensor_parallel_size": "2", ...}``."""
    out: dict[str, str] = {}
    it = iter(list(args))
    for a in it:
        if not a.startswith("--") or len(a) <= 2:
            raise ConfigError(
                f"unexpected argument {a!r}; filters look like --tensor_parallel_size 2 or --dtype=bf16")
        key, eq, val = a[2:].partition("=")
        if not eq:
            try:
                val = next(it)
            except StopIteration:
                raise ConfigError(f"filter --{key} needs a value, e.g. --{key} 2") from None
        out[key] = val
    return out


__all__ = [
    "EXPORTS_PREFIX",
    "KEY_ALIASES",
    "ExportRecord",
    "config_id",
    "lookup",
    "make_record",
    "model_path",
    "normalize_config",
    "normalize_key",
    "normalize_value",
    "parse_filter_args",
    "record_name",
    "task_segment",
]
