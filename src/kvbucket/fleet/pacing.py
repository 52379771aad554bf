"""When a node's next fleet round is due: by the clock, or by the node's own data requests.

**Clock-driven** (the default): a round every ``sync_secs``; a node that published nothing and
learned nothing doubles its wait up to ``idle_sync_secs``; its next store or load cuts the wait
back. Cost per node: about ``120 / sync_secs`` requests a minute whatever it serves.

**Activity-driven** (``coordination_ratio`` r): every data request (a chunk stored or loaded)
earns the node r of a request; a round is due once the credit pays for it (its journal PUT,
the compactor's later GET and DELETE of that journal, and the digest GET: 4), but never sooner than
``sync_secs`` after the last. So a busy node spends at most r of its data requests on
coordination, and its rounds come faster the busier it is. A node in use (it served a request
or has records to publish) still rounds at least every ``max_sync_secs / 4`` (the *stage*), so
a chunk is published, folded by the compactor and read by any node in use within
``max_sync_secs`` (the last quarter covers the requests themselves). Between two rounds at
most ``(4 + CREDIT_CAP) / r`` data requests' records wait, so the number of chunks no other
node can see yet is bounded as well as the time. A node that served nothing backs off up to
``idle_sync_secs``; its first request cuts the wait back to a stage (until that round its view
may be up to ``idle_sync_secs`` old: lookups then miss, never hit wrongly). The
compactor rounds at least every stage whatever it serves: the others' news waits for it.

Every coordination request spends one credit (:meth:`Pacer.spend`), also those the deadline
forces, so a node near its threshold repays them; the credit stays within ``+-CREDIT_CAP``.
"""

from __future__ import annotations

import threading
import time

from kvbucket.fleet.config import FleetConfig

#: Credit kept (or owed) at most, in requests: a busy spell after a quiet one buys no flurry.
CREDIT_CAP = 4.0
#: What a round of a node (not the compactor) costs: its journal PUT, the compactor's GET and
#: later DELETE of that journal (paid by the writer, so the fleet as a whole stays within the
#: ratio) and the digest GET. The compactor's round: the listing, the digest PUT, its own
#: journal and that journal's DELETE.
ROUND_COST = 4.0


class Pacer:
    """The fleet thread asks :meth:`wait` for the next round; the host's requests call
    :meth:`earn` from any thread."""

    def __init__(self, config: FleetConfig, stop: threading.Event) -> None:
        self.config = config
        self.ratio = config.coordination_ratio
        self.stage = config.stage_secs
        self.interval = self.stage  # the current longest wait (grows while idle)
        self.credit = 0.0
        self._active = False  # served a request since the last round started
        self._hurried = False
        self._wake = threading.Event()
        self._stop = stop

    def earn(self, n: int) -> None:
        """``n`` data requests served: credit, and the end of an idle wait."""
        self._active = True
        if self.ratio is not None:
            self.credit = min(CREDIT_CAP, self.credit + self.ratio * n)
            if self.credit >= ROUND_COST:
                self._wake.set()
        if self.interval > self.stage:
            self._hurried = True
            self._wake.set()

    def hurry(self) -> None:
        """Records to publish (a delete): an idle wait ends as for a request."""
        self._active = True
        if self.interval > self.stage:
            self._hurried = True
            self._wake.set()

    def spend(self, n: int) -> None:
        if self.ratio is not None:
            self.credit = max(-CREDIT_CAP, self.credit - n)

    def wake(self) -> None:
        self._wake.set()

    def wait(self, last: float) -> bool:
        """Sleep until the next round is due (True: stop was asked). ``last``: the monotonic
        start of the previous round."""
        while not self._stop.is_set():
            end = last + self.interval
            if self._hurried:
                end = min(end, last + self.stage)
            if self.ratio is not None and self.credit >= ROUND_COST:
                end = min(end, last + self.config.sync_secs)
            left = end - time.monotonic()
            if left <= 0:
                return False
            if self._wake.wait(left):
                self._wake.clear()
        return True

    def begin_round(self) -> bool:
        """A round starts: whether the node served requests since the last one."""
        active, self._active, self._hurried = self._active, False, False
        return active

    def end_round(self, *, active: bool, news: bool, busy: bool, compactor: bool) -> None:
        """Set the next wait. Clock-driven: ``sync_secs`` after a round with news (published
        or learned), else back off. Activity-driven: the stage while the node is in use (it
        served requests or published), over the watermark or the compactor, else back off."""
        keep = news if self.ratio is None else active or compactor
        if keep or busy:
            self.interval = self.stage
        else:
            self.interval = min(2 * self.interval, self.config.idle_secs)


__all__ = ["CREDIT_CAP", "ROUND_COST", "Pacer"]
