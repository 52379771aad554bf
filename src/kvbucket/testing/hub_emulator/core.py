"""The emulator's live objects: durable state, auth, faults, counters and the CPU pool.

Kept apart from ``app`` (routing, middleware) so the route modules can be handed an ``Emulator``
without importing the module that imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import zerocopy
from .auth import Auth
from .faults import FaultPlan
from .request_log import RequestLog
from .state import State
from .wire import BODY_TIMEOUT_S
from .xorb_gc import DEFAULT_XORB_GRACE_S, Collected, XorbCollector

log = logging.getLogger("kvbucket.emulator")
#: A xorb temp file not written for this long has no writer left (``State.sweep_temps``): well
#: past a body's idle timeout plus its verification and fsync.
STALE_TEMP_S = 120.0
#: Deleting time of one background collection pass; what is left waits for the next pass.
GC_PASS_BUDGET_S = 30.0


@dataclass
class RouteStats:
    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    tls: int = 0  # requests that came over TLS: a test's proof that its fetches did (TLS mode)


class Emulator:
    """The server's live objects: durable state, auth, faults, counters and the CPU pool."""

    def __init__(
        self,
        state: State,
        auth: Auth,
        faults: FaultPlan | None = None,
        admin_key: str = "",
        zero_copy: bool = True,
        body_timeout_s: float = BODY_TIMEOUT_S,
        xorb_grace_s: float = DEFAULT_XORB_GRACE_S,
    ) -> None:
        self.state = state
        self.collector = XorbCollector(state, xorb_grace_s)
        self._gc: asyncio.TimerHandle | None = None
        self._collecting: asyncio.Future[Any] | None = None
        self.body_timeout_s = body_timeout_s
        self.zero_copy = zero_copy and zerocopy.supported(state.xorb_dir)
        self.auth = auth
        self.faults = faults or FaultPlan()
        self.admin_key = admin_key
        self.stats: dict[str, RouteStats] = defaultdict(RouteStats)
        self.statuses: dict[str, int] = defaultdict(int)
        self.requests = RequestLog()  # (route, start, end) of each request: round trips, server-side
        self.pool = ThreadPoolExecutor(
            max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="emu"
        )
        # Waits on the disk (a received xorb's fsync), apart from the CPU pool: an fsync of
        # 64 MiB holds its thread for 0.1-0.3 s without using a CPU, and two of them in the CPU
        # pool stalled every other xorb's verification behind them.
        self.disk_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="emu-disk")
        self.started = time.monotonic()
        self.stale_temp_s = max(STALE_TEMP_S, 4 * body_timeout_s)
        self._sweep: asyncio.TimerHandle | None = None
        self._sweeping: asyncio.Future[None] | None = None

    async def stop_sweeping(self) -> None:
        """Cancel the later look at young temp files and let its task end in this loop: a task
        still pending when the loop closes is logged as destroyed (an ERROR in every log)."""
        for handle in (self._sweep, self._gc):
            if handle is not None:
                handle.cancel()
        for task in (self._sweeping, self._collecting):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def gc_interval_s(self) -> float:
        """How often unreferenced xorbs are looked for: a quarter of the grace, 5 s to 1 h (a pass
        reads the whole index: not more often than that)."""
        return min(3600.0, max(5.0, self.collector.grace_s / 4))

    def schedule_gc(self) -> None:
        """Collect unreferenced xorbs in the background, every ``gc_interval_s``."""
        loop = asyncio.get_running_loop()

        def run() -> None:
            self._collecting = asyncio.ensure_future(self.collect_xorbs(budget_s=GC_PASS_BUDGET_S))
            self._collecting.add_done_callback(again)

        def again(task: asyncio.Future[Any]) -> None:
            if not task.cancelled():
                task.exception()  # logged by collect_xorbs; retrieved so asyncio does not repeat it
                self.schedule_gc()

        self._gc = loop.call_later(self.gc_interval_s(), run)

    async def collect_xorbs(self, grace_s: float | None = None, budget_s: float = 600.0) -> Collected:
        """One collection pass off the event loop (see ``xorb_gc``); errors are logged, not raised
        into the background loop."""
        try:
            return await self.disk(self.collector.collect, grace_s, budget_s)  # type: ignore[no-any-return]
        except Exception:
            log.exception("xorb collection failed; the next pass tries again")
            raise

    def close(self) -> None:
        for handle in (self._sweep, self._gc):
            if handle is not None:
                handle.cancel()
        self.pool.shutdown(wait=True)
        self.disk_pool.shutdown(wait=True)

    async def sweep_temps(self, paths: list[Any] | None = None) -> None:
        """Remove the xorb temp files a killed server left (at start: all of them old enough),
        then look again at the younger ones once they are old enough: a kill just before this
        start, or another live server on this data dir whose files are renamed by then."""
        removed, freed, young = await self.disk(self.state.sweep_temps, self.stale_temp_s, paths)
        if removed:
            log.info("removed %d xorb temp files (%d bytes) left by an upload that never finished "
                     "(a server killed mid-upload)", removed, freed)
        if young:
            loop = asyncio.get_running_loop()

            def again() -> None:
                self._sweeping = asyncio.ensure_future(self.sweep_temps(young))

            self._sweep = loop.call_later(self.stale_temp_s, again)

    async def cpu(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def disk(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.disk_pool, fn, *args)

    def snapshot(self) -> dict[str, Any]:
        return {
            "routes": {k: vars(v).copy() for k, v in sorted(self.stats.items())},
            "statuses": dict(self.statuses),
            "process_cpu_s": time.process_time(),
            "loop_thread_cpu_s": time.thread_time(),
            "uptime_s": time.monotonic() - self.started,
            "pid": os.getpid(),
            "zero_copy_uploads": self.zero_copy,
        }
