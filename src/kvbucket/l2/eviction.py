"""Which keys to evict when an adapter nears its capacity.

Policy ``LRU``: when bytes used reach ``trigger_watermark * capacity``, remove least recently
stored-or-accessed keys until usage is at most ``target = (trigger_watermark - eviction_ratio)
* capacity`` (never below zero). ``noop`` never evicts. Locked keys (between a lookup hit and
its unlock) are never chosen.

Tenants (``cache_salt`` values) are isolated by *fair shares*: each salt that holds bytes is
entitled to an equal share ``target / number_of_salts``. Victims are always taken from the salt
that is furthest above its share, oldest first, so a tenant that churns through many chunks
only evicts its own keys while another tenant stays within its share. A tenant under its share
loses keys only when every over-share tenant has nothing left to evict (all locked). With one
salt this is plain LRU.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Container
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbucket.errors import ConfigError
from kvbucket.l2.accounting import KeyIndex

log = logging.getLogger("kvbucket.l2")


class EvictionConfig(BaseModel):
    """``{"eviction_policy": "LRU"|"noop", "trigger_watermark": 0.8, "eviction_ratio": 0.2}``."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    eviction_policy: Literal["LRU", "noop"] = "LRU"
    trigger_watermark: float = Field(0.8, gt=0.0, le=1.0)
    eviction_ratio: float = Field(0.2, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> EvictionConfig:
        if self.eviction_ratio > self.trigger_watermark:
            raise ValueError(
                f"eviction_ratio ({self.eviction_ratio}) must not exceed trigger_watermark "
                f"({self.trigger_watermark}): eviction empties down to watermark - ratio"
            )
        return self

    def target_bytes(self, capacity: int) -> int:
        return max(0, int((self.trigger_watermark - self.eviction_ratio) * capacity))

    def triggered(self, used: int, capacity: int) -> bool:
        return self.eviction_policy != "noop" and capacity > 0 and used >= self.trigger_watermark * capacity


def effective_eviction(
    eviction: EvictionConfig | None, capacity: int, *, fleet: bool = False
) -> EvictionConfig | None:
    """The eviction an adapter runs: a capacity that is set is enforced, so a capacity without an
    ``eviction`` setting gets the default policy (``LRU``, watermark 0.8, ratio 0.2); a bucket
    that grows without bound is a bill. A fleet without a capacity still runs ``max_age_secs``
    (``noop``). ``{"eviction_policy": "noop"}`` turns it off explicitly (e.g. to let LMCache's
    own controller, the plugin spec's top-level ``"eviction"``, do it). An eviction policy without a
    capacity is refused (ConfigError): it would never evict."""
    if eviction is not None:
        if eviction.eviction_policy != "noop" and capacity <= 0:
            raise ConfigError(
                f"L2 adapter: eviction {eviction.eviction_policy} is set without a capacity, so it would "
                "never evict (an unbounded bucket); add max_capacity_gb next to it, or remove \"eviction\""
            )
        return eviction
    if capacity > 0:
        log.info("a capacity of %d bytes without an eviction setting: evicting LRU (trigger_watermark "
                 "0.8, eviction_ratio 0.2); set \"eviction\" to choose another policy", capacity)
        return EvictionConfig()
    return EvictionConfig(eviction_policy="noop") if fleet else None


def choose_victims(
    index: KeyIndex, capacity: int, config: EvictionConfig, locked: Container[str]
) -> list[str]:
    """Names to delete so usage falls to the target, following the fair-share rule above."""
    if not config.triggered(index.bytes_used, capacity):
        return []
    target = config.target_bytes(capacity)
    usage = index.bytes_by_salt()
    if not usage:
        return []
    share = target / len(usage)
    queues = {salt: deque(n for n in index.oldest(salt) if n not in locked) for salt in usage}
    victims: list[str] = []
    used = index.bytes_used
    while used > target:
        candidates = [s for s, q in queues.items() if q]
        if not candidates:
            break  # everything left is locked
        salt = max(candidates, key=lambda s: usage[s] - share)
        name = queues[salt].popleft()
        entry = index.get(name)
        size = entry.size if entry else 0
        victims.append(name)
        usage[salt] -= size
        used -= size
    return victims


__all__ = ["EvictionConfig", "choose_victims", "effective_eviction"]
