"""An eviction setting without a capacity is refused (issue 40, outside tester F7).

``{"eviction": {"eviction_policy": "LRU", ...}}`` with no ``max_capacity_gb`` reported LRU,
capacity 0, and never evicted, saying nothing: a silent unbounded bucket. It is refused before
the store opens, saying what to add; ``noop`` (no eviction) stays allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbucket.errors import ConfigError
from kvbucket.l2 import open_l2_adapter

EVICT = {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}


@pytest.mark.parametrize("capacity", [None, 0])
def test_eviction_without_a_capacity_is_refused_before_the_store_opens(capacity: float | None,
                                                                        tmp_path: Path) -> None:
    spec = {"type": "fs", "base_path": str(tmp_path / "kv"), "eviction": EVICT}
    if capacity is not None:
        spec["max_capacity_gb"] = capacity
    with pytest.raises(ConfigError, match="add max_capacity_gb"):
        open_l2_adapter(spec)
    assert not (tmp_path / "kv").exists()


def test_eviction_with_a_capacity_and_noop_without_one_are_taken(tmp_path: Path) -> None:
    with open_l2_adapter({"type": "fs", "base_path": str(tmp_path / "a"), "eviction": EVICT,
                          "max_capacity_gb": 1}) as a:  # fmt: skip
        assert a.report_status()["eviction_policy"] == "LRU"
    with open_l2_adapter({"type": "fs", "base_path": str(tmp_path / "b"),
                          "eviction": {"eviction_policy": "noop"}}) as b:  # fmt: skip
        assert b.report_status()["eviction_policy"] == "noop"
