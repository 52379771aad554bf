"""One request of a Xet read retried on its own: a part's reconstruction or one ranged fetch.

Why here and not only around the whole object (hub/store.py ``_download``): an object read in
parts is 2 x parts requests (a reconstruction and a fetch each), so with parts of 2 MiB a 10%
rate of 503s failed 3 loads in 8 when any one of them failed the object (issue 41's tester,
attack f_fault_amp), and each whole-object retry asked for every part again after a backoff
from 0.5 s. A request that fails transiently (408/429/5xx, a dropped connection, a body cut
short: what :class:`~kvbucket.errors.TransientStoreError` says) is sent again, at most
``retries`` times with a short doubling backoff, never past the load's deadline; the parts
already read keep their bytes.

**Invariant (a retried fetch writes only its own bytes, through the same gate).** A fetch
writes its range of the destination from its first byte each time it is sent, through the
read's gate (an abandoned read writes nothing: the gate raises ``Abandoned``, which is never
retried); a :class:`~kvbucket.stores.buffers.Scatter` whose hashed bytes are written again marks
itself ``rewritten`` and the sealing layer hashes the payload again (stores/buffers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvbucket.errors import TransientStoreError
from kvbucket.stores.deadline import left

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Retries of one request when the reader is not told (the Hub store passes its ``max_retries``).
RETRIES = 3
#: The first wait before a retry (doubling), at most the store's ``retry_backoff_secs``.
BACKOFF_SECS = 0.05
#: No wait between two attempts of one request is longer than this.
MAX_WAIT_SECS = 1.0


def retried(call: Callable[[], T], what: str, *, retries: int, backoff: float, deadline: float) -> T:
    """``call()``, sent again on a :class:`TransientStoreError` up to ``retries`` times (after
    ``backoff``, doubling) while the wait ends before ``deadline``; the last error is raised."""
    delay = max(0.0, backoff)
    attempt = 0
    while True:
        try:
            return call()
        except TransientStoreError as e:
            wait = min(delay, MAX_WAIT_SECS)
            if attempt >= retries or wait >= left(deadline):
                raise
            log.debug("retrying %s in %.3fs after: %s", what, wait, e)
            time.sleep(wait)
            delay = max(delay * 2, 0.001)
            attempt += 1


__all__ = ["BACKOFF_SECS", "MAX_WAIT_SECS", "RETRIES", "retried"]
