"""What the Hub says about stored objects (paths-info and tree entries), parsed for the hot path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """What the Hub says about one stored object."""

    path: str
    size: int
    xet_hash: str
    mtime: float | None = None


def _mtime_seconds(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value) / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str) and value:
        from datetime import datetime

        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def remote_file(entry: dict[str, Any], with_mtime: bool = False) -> RemoteFile | None:
    if entry.get("type", "file") != "file":
        return None
    return RemoteFile(
        entry["path"], int(entry["size"]), str(entry.get("xetHash") or ""),
        _mtime_seconds(entry.get("mtime")) if with_mtime else None,
    )


__all__ = ["RemoteFile", "remote_file"]
