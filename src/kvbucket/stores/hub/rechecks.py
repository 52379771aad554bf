"""A writer asks again about what it committed: it closes the Hub's compare-to-delete window.

The Hub's batch API removes a path with no condition (huggingface_hub's ``deleteFile`` names a
path, nothing else), so a delete by version (a refusal, an eviction, ``verify --delete-bad``,
``rm --identity``: stores/hub/versions.py) compares the Xet hash it judged by paths-info, then
sends the delete: a write committed between the two is removed with the judged version. The
deleter bounds that window: it sends the delete within ``delete_window_secs`` of sending its
compare (else it compares again), and no retry starts past it. The writer closes it: it keeps
(path, Xet hash, mtime) of each object it committed and, ``recheck_delay_secs`` later (longer
than any deleter's window, so a racing delete has landed by then), asks paths-info about them,
the commits of about a second in one request:

- the path holds that hash: kept (nothing more);
- another hash with a later mtime (ties: the greater hash): written since by someone newer; left
  alone;
- another hash with an earlier mtime: a stale version (another writer's re-add of what it wrote
  before us keeps that older mtime): treated as gone, so a stale re-add never beats a newer
  version; the strict order (mtime, then hash) means two writers never both give way nor both win;
- gone: added back by its hash in one batch commit (no upload: the bytes are in the CAS).

Never damaged bytes: a store given a verifier (a sealed store hands its envelope check:
:meth:`Rechecks.verify_with`) first reads what it would add back by its Xet hash and adds it only
if intact (else counted ``damaged``: a reader that judged it damaged and removed it is not undone).
An unsealed store has no judgement of damage and adds back unread.

A name removed less than ``recheck_delay_secs`` after a running writer committed it therefore
comes back with that writer's bytes: a user's ``rm`` of a name a live engine just wrote (it
would have written it again), an eviction of the version just written (evicted again later).
The re-add has no condition either: a third writer committing in its own window is replaced by
the re-added version, an older valid one (its own re-check then sees an older version and puts
its own back). This store's own deletes forget what they remove, and
a path this store is writing again is not re-added. ``close`` runs the pending checks at once
(it does not wait until they are due: a delete still in flight then, racing a write committed
less than ``delete_window_secs`` before, is not seen); so does a process ending without
``close`` (an ``atexit`` hook); a killed one runs none. docs/hfbucket.md.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Counter

from kvbucket.errors import StoreError
from kvbucket.stores.base import ItemResult
from kvbucket.stores.deadline import deadline_in
from kvbucket.stores.hub.client import HUB_BATCH_LIMIT, HubBucketClient
from kvbucket.stores.hub.files import RemoteFile
from kvbucket.stores.hub.meta_cache import MetaCache
from kvbucket.threads import DEFAULT_CLOSE_TIMEOUT_SECS

log = logging.getLogger(__name__)

HUB_RECHECKS = Counter(
    "kvbucket_hub_rechecks",
    "Objects a Hub writer asked about again recheck_delay_secs after committing them, by outcome: kept "
    "(still its version), newer (another version with a later mtime: left alone), readded (removed "
    "since, or replaced by an older version, and added back by its Xet hash), damaged (would have been "
    "added back but its bytes fail the verifier: left removed), failed (the check or the re-add "
    "failed: it may stay removed).",
    ["outcome"],
)
HUB_DELETE_WINDOW = Counter(
    "kvbucket_hub_delete_window",
    "Hub deletes by version whose compare-to-delete window ran long, by outcome: recompared (compared "
    "again before sending, past delete_window_secs/2), gave_up (every compare answered too late: the "
    "delete was not sent, the objects kept), late (the delete's answer came more than "
    "recheck_delay_secs after its compare: a write in that window may be lost).",
    ["outcome"],
)

#: Stores with checks pending, closed at interpreter exit (a process that never calls close()).
_LIVE: weakref.WeakSet[Rechecks] = weakref.WeakSet()

#: Due checks are run together: the first waits this long (at most) for others to become due.
COALESCE_SECS = 1.0


#: Judges bytes about to be added back: (object name, bytes) -> intact? (a sealed store's envelope check)
Verifier = Callable[[str, memoryview], bool]


@dataclass(slots=True)
class _Pending:
    name: str  # the store's object name (what a verifier is given)
    xet_hash: str
    size: int
    mtime: int  # milliseconds, as committed
    due: float  # monotonic


class Rechecks:
    """The pending re-checks of one store; a daemon thread runs them as they become due."""

    def __init__(self, client: HubBucketClient, url: str, delay_secs: float, cache: MetaCache[RemoteFile]
                 ) -> None:
        """``cache``: the store's metadata cache (a re-add is this store's write; a newer version
        or a path left removed drops its entry)."""
        self._client = client
        self.url = url
        self.delay = float(delay_secs)
        self._coalesce = min(COALESCE_SECS, self.delay / 4)
        self._cache = cache
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}  # in commit order: the first is due first
        self._writing: Tally[str] = Tally()  # paths this store is committing right now
        self._thread: threading.Thread | None = None
        self._busy = 0  # checks the thread is running
        self._closed = False
        self._verify: Verifier | None = None

    def verify_with(self, verifier: Verifier | None) -> None:
        """Add back only bytes ``verifier`` finds intact (read by their Xet hash first)."""
        self._verify = verifier

    @property
    def enabled(self) -> bool:
        return self.delay > 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending)

    @contextmanager
    def writing(self, paths: Sequence[str]) -> Iterator[None]:
        """Around this store's commit of ``paths``: a check due meanwhile does not re-add them."""
        with self._cond:
            self._writing.update(paths)
        try:
            yield
        finally:
            with self._cond:
                for p in paths:
                    if self._writing[p] > 1:
                        self._writing[p] -= 1
                    else:
                        del self._writing[p]

    def committed(self, paths: Sequence[str], results: Sequence[ItemResult], mtime_ms: int) -> None:
        """A batch of ``paths`` was committed with ``mtime_ms``: each stored item (its result has
        a version) is asked about again later."""
        if not self.enabled:
            return
        due = time.monotonic() + self.delay
        with self._cond:
            if self._closed:
                return
            for p, r in zip(paths, results, strict=True):
                if r.ok and r.version and r.size is not None:
                    self._pending.pop(p, None)  # re-inserted last: the dict stays in due order
                    self._pending[p] = _Pending(r.name, r.version, r.size, mtime_ms, due)
            _LIVE.add(self)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbucket-hub-rechecks", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def forget(self, paths: Sequence[str], versions: Sequence[str] | None = None) -> None:
        """This store removes ``paths`` (only where its pending hash is ``versions[i]``, if given)."""
        with self._cond:
            for i, p in enumerate(paths):
                e = self._pending.get(p)
                if e is not None and (versions is None or versions[i] == e.xet_hash):
                    del self._pending[p]

    def _take(self, until: float) -> list[tuple[str, _Pending]]:
        """The pending checks due by ``until``, removed from the queue (under the lock)."""
        out = []
        for p, e in self._pending.items():
            if e.due > until:
                break
            out.append((p, e))
        for p, _ in out:
            del self._pending[p]
        return out

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._pending:
                    first = next(iter(self._pending.values())).due
                    wait = first + self._coalesce - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed or not self._pending:
                    self._thread = None
                    return
                due = self._take(time.monotonic())
                self._busy += 1
            try:
                self._check(due)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def settle(self, timeout: float | None = None) -> int:
        """Wait until every pending check is due (at most ``timeout``, default the delay) and has
        run (here, or on the thread); how many ran here."""
        until = time.monotonic() + (self.delay if timeout is None else timeout)
        ran = 0
        while True:
            with self._cond:
                now = time.monotonic()
                due = self._take(now)  # what is due runs, even when this wait woke up late
                if not due:
                    if not self._pending and not self._busy:
                        return ran
                    first = next(iter(self._pending.values())).due if self._pending else until
                    if now >= until or first > until:
                        return ran
                    self._cond.wait(min(until, first) - now)  # the first due, or the thread's check
                    continue
            self._check(due)
            ran += len(due)

    def _check(self, due: list[tuple[str, _Pending]], secs: float = 30.0) -> None:
        """Ask about ``due`` (one paths-info per 1,000), add back what is gone; within ``secs``."""
        if not due:
            return
        paths = [p for p, _ in due]
        deadline = deadline_in(secs)
        try:
            now = self._client.paths_info(paths, deadline, with_mtime=True)
        except StoreError as e:
            HUB_RECHECKS.labels("failed").inc(len(due))
            log.warning("could not ask %s whether %d object(s) written %gs ago are still there: %s",
                        self.url, len(due), self.delay, e)
            return
        gone: list[tuple[str, _Pending]] = []
        kept = newer = 0
        for p, e in due:
            f = now.get(p)
            if f is None:
                gone.append((p, e))
            elif f.xet_hash == e.xet_hash:
                kept += 1
            elif _older(f, e):  # a stale version (a re-add of an older write): ours goes back
                gone.append((p, e))
            else:
                newer += 1
        HUB_RECHECKS.labels("kept").inc(kept)
        HUB_RECHECKS.labels("newer").inc(newer)
        self._cache.invalidate(p for p, e in due if (f := now.get(p)) is None or f.xet_hash != e.xet_hash)
        with self._cond:  # this store is writing it again, or wrote it again since: that write wins
            gone = [(p, e) for p, e in gone if not self._writing[p] and p not in self._pending]
        gone = self._intact(gone, deadline)
        for i in range(0, len(gone), HUB_BATCH_LIMIT):
            self._readd(gone[i : i + HUB_BATCH_LIMIT], deadline)

    def _intact(self, gone: list[tuple[str, _Pending]], deadline: float) -> list[tuple[str, _Pending]]:
        """Those of ``gone`` whose bytes, read by their Xet hash, the verifier finds intact (all of
        them without a verifier); a read that fails counts ``failed``, a refusal ``damaged``."""
        verify = self._verify
        if verify is None or not gone:
            return gone
        out = []
        damaged = failed = 0
        for p, e in gone:
            if time.monotonic() > deadline:
                failed += 1
                continue
            data = bytearray(e.size)
            try:
                # a plain read (not download_afresh: that resets the store's download group and
                # read token, which its concurrent reads share)
                self._client.download_into(RemoteFile(p, e.size, e.xet_hash), memoryview(data), None,
                                           deadline)
            except Exception as err:
                failed += 1
                log.warning("could not read back %s (written to %s) to add it back: %s", p, self.url, err)
                continue
            try:
                ok = verify(e.name, memoryview(data))
            except Exception:
                ok = False
            if ok:
                out.append((p, e))
            else:
                damaged += 1
        HUB_RECHECKS.labels("damaged").inc(damaged)
        HUB_RECHECKS.labels("failed").inc(failed)
        if damaged:
            log.warning("%d object(s) written to %s were removed since and read back damaged: left removed",
                        damaged, self.url)
        return out

    def _readd(self, gone: list[tuple[str, _Pending]], deadline: float) -> None:
        ops = [{"type": "addFile", "path": p, "xetHash": e.xet_hash, "mtime": e.mtime} for p, e in gone]
        try:
            failed = self._client.commit_batch(ops, deadline, "add back objects removed since written")
        except StoreError as e:
            failed = {p: str(e) for p, _ in gone}
        done = [(p, RemoteFile(p, e.size, e.xet_hash)) for p, e in gone if p not in failed]
        HUB_RECHECKS.labels("readded").inc(len(done))
        HUB_RECHECKS.labels("failed").inc(len(gone) - len(done))
        self._cache.set_written(done)
        if done:
            log.info("%d object(s) written to %s were removed by a delete that raced the write: added back",
                     len(done), self.url)
        if failed:
            log.warning("%d object(s) written to %s were removed since and could not be added back (%s)",
                        len(failed), self.url, next(iter(failed.values())))

    def close(self) -> None:
        """Run every pending check now, due or not (one request), and stop the thread.

        Not waiting keeps ``close`` quick; what it cannot see is a delete still in flight, one
        whose compare came before a write committed less than ``delete_window_secs`` ago.
        """
        _LIVE.discard(self)
        with self._cond:
            due = self._take(float("inf"))
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        self._check(due, DEFAULT_CLOSE_TIMEOUT_SECS)  # a Hub that does not answer: close goes on
        if thread is not None:
            thread.join(DEFAULT_CLOSE_TIMEOUT_SECS)  # a check in flight: bounded by its own deadline


@atexit.register
def _close_at_exit() -> None:
    """A process ending without ``close()`` (a normal exit, an unhandled exception, ``sys.exit``)
    runs its pending checks, each store bounded as its ``close`` is. A process killed (SIGKILL,
    OOM) runs nothing: what a racing delete took in its last ``recheck_delay_secs`` stays removed."""
    for r in list(_LIVE):
        try:
            r.close()
        except Exception as e:
            log.warning("could not run the pending re-checks of %s at exit: %s", r.url, e)


def _older(f: RemoteFile, e: _Pending) -> bool:
    """Whether the version ``f`` the bucket holds is older than ours, ``e``: strictly by (mtime in
    ms, Xet hash), so of two writers exactly one sees the other's as older. Unknown mtime: not older."""
    if f.mtime is None:
        return False
    return (round(f.mtime * 1000), f.xet_hash) < (e.mtime, e.xet_hash)


def window_deadline(compared_at: float, window_secs: float, deadline: float) -> float:
    """The last instant a delete compared at ``compared_at`` may be sent (or retried)."""
    return min(deadline, compared_at + window_secs)


def note_late(compared_at: float, delay_secs: float) -> None:
    """Count (and log) a delete whose answer came after the writers' re-check delay."""
    late = time.monotonic() - compared_at
    if delay_secs > 0 and late > delay_secs:
        HUB_DELETE_WINDOW.labels("late").inc()
        log.warning("a delete by version was answered %.1fs after its compare, past recheck_delay_secs=%g: "
                    "a write committed in between may be lost", late, delay_secs)


__all__ = ["HUB_DELETE_WINDOW", "HUB_RECHECKS", "Rechecks", "note_late", "window_deadline"]
