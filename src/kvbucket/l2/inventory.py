"""What the adapter holds: usage, the startup rebuild from the store's listing, key listing, status.

The index is rebuilt from the store's listing at start (in the background) and kept exact
afterwards; objects whose names parse as neither kvbucket's nor LMCache's are counted as foreign.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from types import MappingProxyType
from typing import Any

from kvbucket.errors import KVBucketError
from kvbucket.fleet.layout import is_fleet_name
from kvbucket.identity.manifest import is_manifest_name
from kvbucket.keys import ObjectKey
from kvbucket.l2.base import KeyPage, Usage
from kvbucket.l2.context import AdapterContext
from kvbucket.l2.core import log
from kvbucket.l2.eviction import EvictionConfig
from kvbucket.stores.guard.breaker import OPEN, breaker_of

_REBUILD_PAGE = 1000


class InventoryPath:
    """Usage, rebuild, listing and status."""

    def __init__(
        self,
        ctx: AdapterContext,
        *,
        capacity: int,
        eviction: EvictionConfig | None,
    ) -> None:
        self._ctx = ctx
        self._naming = ctx.names.naming
        self._prefix = ctx.prefix
        self._capacity = capacity
        self._eviction = eviction

    def get_usage(self) -> Usage:
        st = self._ctx.state
        with st.lock:
            return Usage(
                bytes_used=st.index.bytes_used,
                capacity_bytes=self._capacity,
                bytes_by_cache_salt=MappingProxyType(st.index.bytes_by_salt()),
                complete=st.rebuilt,
            )

    def wait_until_rebuilt(self, timeout: float | None = None) -> bool:
        """Block until the startup listing has been read (for tools and tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ctx.state.rebuilt:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    async def rebuild(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._ctx.runner.pool, self._rebuild_sync)
        except Exception as e:
            # A store's own error (a missing bucket, a refused token) already says what is wrong in
            # one line: a traceback adds nothing for it. Anything else is a bug: keep its trace.
            (log.warning if isinstance(e, KVBucketError) else log.exception)(
                "could not list %s to rebuild usage (%s); usage counts only this run's stores",
                self._ctx.store.url,
                e,
            )
            self._ctx.stats.note_error("list", f"usage rebuild failed: {type(e).__name__}: {e}")
        else:
            self._ctx.stats.note_ok("list")
        finally:
            with self._ctx.state.lock:
                self._ctx.state.rebuilt = True
                self._ctx.state.deleted_while_rebuilding.clear()

    def _identity_known(self) -> bool:
        try:
            return self._naming.identity.wait(1.0)
        except KVBucketError:  # its computation failed (logged); retried by the setting
            time.sleep(1.0)
            return False

    def _rebuild_sync(self) -> None:
        st = self._ctx.state
        while not self._identity_known():  # names are read by identity: known first
            if st.closed:
                return
        prefix = f"{self._prefix}/" if self._prefix else ""
        page: list[tuple[str, ObjectKey, int, float, str | None]] = []

        def flush() -> None:
            # Newest first with touch=False, so the oldest ends up at the LRU end.
            page.sort(key=lambda t: t[3], reverse=True)
            with st.lock:
                for name, key, size, _, version in page:
                    if (
                        name not in st.deleted_while_rebuilding
                        and name not in st.deleting
                        and name not in st.storing
                    ):
                        st.index.add(name, key, size, touch=False, version=version)
            page.clear()

        for info in self._ctx.store.list(prefix):
            if st.closed:
                return
            key = self._naming.parse(info.name)  # kvbucket's names and LMCache's
            if key is None:
                if not (is_fleet_name(info.name, self._prefix) or is_manifest_name(info.name, self._prefix)):
                    self._ctx.stats["foreign_objects"] += 1
                continue
            page.append((info.name, key, info.size, info.mtime or 0.0, info.version))
            if len(page) >= _REBUILD_PAGE:
                flush()
        flush()

    def list_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyPage:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if cursor is not None and (not isinstance(cursor, str) or not cursor):
            raise ValueError("cursor must be the non-empty string returned as next_cursor")
        st = self._ctx.state
        start = f"{self._prefix}/" if self._prefix else ""
        if st.rebuilt:
            with st.lock:
                names = sorted(
                    (n, e.key, e.size)
                    for n in st.index.names()
                    if (e := st.index.get(n)) is not None
                    and (not model_name or e.key.model_name == model_name)
                )
        else:
            names = []
            for info in self._ctx.store.list(start):
                key = self._naming.parse(info.name)
                if key is None or (model_name and key.model_name != model_name):
                    continue
                names.append((info.name, key, info.size))
            names.sort()
        pos = bisect_right([n for n, _, _ in names], cursor) if cursor else 0
        chunk = names[pos : pos + page_size]
        more = pos + page_size < len(names)
        return KeyPage(tuple((k, s) for _, k, s in chunk), chunk[-1][0] if more and chunk else None)

    def report_status(self) -> dict[str, Any]:
        st = self._ctx.state
        usage = self.get_usage()
        with st.lock:
            locked = sum(1 for c in st.key_locks.values() if c > 0)
            keys = len(st.index)
        stats = self._ctx.stats
        breaker = breaker_of(self._ctx.store)
        error = stats.current_error(None if breaker is None else breaker.answered_at)
        return {
            # closed, its store's circuit breaker open, or the last answer an error: not serving
            # (never healthy next to a current error)
            "is_healthy": not st.closed and (breaker is None or breaker.state != OPEN) and error is None,
            "store": self._ctx.store.url,
            "prefix": self._prefix,
            "keys": keys,
            "bytes_used": usage.bytes_used,
            "capacity_bytes": usage.capacity_bytes,
            "usage_fraction": usage.usage_fraction,
            "usage_complete": usage.complete,
            "locked_keys": locked,
            "inflight_tasks": len(self._ctx.runner.inflight),
            "full_chunk_bytes": st.full_fixed if st.full_fixed is not None else dict(st.full),
            "eviction_policy": self._eviction.eviction_policy if self._eviction else None,
            # the error of now: None once a store call fully succeeded after it (then it moves
            # to previous_error); last_error_at: when the last error happened, either way
            "last_error": error,
            "previous_error": stats.last_error if error is None else None,
            "last_error_at": stats.last_error_at,
            "identity_pending": self._naming.identity.pending_counts(),  # misses, stores dropped meanwhile
            **self._ctx.stats,
            **({"fleet": self._ctx.fleet.status()} if self._ctx.fleet is not None else {}),
        }
