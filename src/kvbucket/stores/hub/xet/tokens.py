"""A bucket's Xet tokens (one for reads, one for writes): cached, renewed shortly before they
expire, and fetched once for every caller that needs one at the same time.

The deadline rule (docs/reliability.md) as it applies here: no lock is held across the token
request. The fetch runs on a thread of its own (never on one of the client's request threads:
reconstruction queries waiting for the token there could keep it from starting); each caller
waits for it until its own deadline at most. A fetch still running past the deadline of the
call that started it is stuck (a server trickling its answer): it is not joined any more, and
the next caller sends a new request, so one slow answer fails the calls of one budget, not
every call until the server finishes it (issue 29 item 3: ~42 s of failed loads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from kvbucket.errors import DeadlineExceededError
from kvbucket.stores.deadline import left

#: A Xet token counts as expiring this long before its ``exp`` (huggingface_hub's
#: XET_CONNECTION_INFO_SAFETY_PERIOD), or a quarter of its lifetime when that is shorter than
#: four times this (see token_margin).
TOKEN_SAFETY_SECS = 60
_TOKEN_SAFETY_SHARE = 0.25

Token = tuple[str, int, str]  # (token, exp unix seconds, cas_url)


def token_margin(exp: float, now: float) -> float:
    """How long before ``exp`` a token received at ``now`` is renewed: 60 s, or a quarter of its
    lifetime when it lives less than 4 minutes. Why not a flat 60 s: a token issued for 60 s or
    less was stale when it arrived, so every reconstruction query of a load asked for a new one
    (33 token requests for a 32-object load at a 30 s TTL)."""
    return min(float(TOKEN_SAFETY_SECS), max(0.0, exp - now) * _TOKEN_SAFETY_SHARE)


class XetToken:
    """One kind of token of one bucket. ``fetch(deadline)`` asks the Hub for a new one (with its
    retries, ending by ``deadline``); ``what`` names it in errors."""

    def __init__(self, fetch: Callable[[float], Token], what: str, default_secs: float) -> None:
        self._fetch = fetch
        self._what = what
        self._default_secs = default_secs  # the budget of a caller that gives none
        self._lock = threading.Lock()
        self.current: Token | None = None
        self.margin = float(TOKEN_SAFETY_SECS)  # renew this long before exp (set per token)
        self._pending: tuple[Future[Token], float] | None = None  # the fetch in flight, joined until

    def fresh(self) -> Token | None:
        """The cached token while it has more than its margin left, else None."""
        tok = self.current
        return tok if tok is not None and tok[1] > time.time() + self.margin else None

    def get(self, deadline: float | None = None) -> Token:
        """A fresh token, waited for until ``deadline`` at most (default: ``default_secs``)."""
        until = deadline if deadline is not None else time.monotonic() + self._default_secs
        tok, fut = self.start(until)
        if tok is not None:
            return tok
        assert fut is not None
        try:
            return fut.result(timeout=max(0.001, left(until)))
        except FutureTimeout:
            self._drop(fut)  # stuck past this caller's budget: the next caller sends a new request
            raise DeadlineExceededError(f"{self._what} did not arrive in time") from None

    def start(self, until: float) -> tuple[Token | None, Future[Token] | None]:
        """The fresh token, or the fetch to wait for: the one in flight unless past its own
        deadline, else a new one that ends by ``until`` (a caller that will not wait: warming)."""
        with self._lock:
            tok = self.fresh()
            if tok is not None:
                return tok, None
            pending = self._pending
            if pending is not None and pending[1] > time.monotonic():
                return None, pending[0]
            fut: Future[Token] = Future()
            self._pending = (fut, until)

        def run() -> None:
            try:
                got = self._fetch(until)
            except BaseException as e:  # every waiter gets it
                self._drop(fut)
                fut.set_exception(e)
                return
            with self._lock:
                self.current, self.margin = got, token_margin(got[1], time.time())
                if self._pending is not None and self._pending[0] is fut:
                    self._pending = None
            fut.set_result(got)

        threading.Thread(target=run, name="kvbucket-hub-token", daemon=True).start()
        return None, fut

    def forget(self, stale: str | None = None) -> None:
        """Drop the cached token (only if it is ``stale``, when given): the next caller fetches."""
        with self._lock:
            if self.current is not None and (stale is None or self.current[0] == stale):
                self.current = None

    def _drop(self, fut: Future[Token]) -> None:
        with self._lock:
            if self._pending is not None and self._pending[0] is fut:
                self._pending = None


__all__ = ["TOKEN_SAFETY_SECS", "Token", "XetToken", "token_margin"]
