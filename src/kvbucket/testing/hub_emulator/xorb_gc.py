"""Xorb garbage collection: drop the xorbs no live file needs, once they have been unused a while.

Why a grace period: hf_xet keeps the shards it uploaded in a local shard cache and dedups new
uploads against them (xet-core ``MDB_SHARD_LOCAL_CACHE_EXPIRATION``: 3 weeks), so a client may
send a shard naming a xorb it uploaded weeks ago and does not upload again. Between a shard
upload and the ``addFile`` that commits its file, the file's xorbs are referenced by no file
either. A xorb is therefore dropped only when no file entry's reconstruction uses it, its file's
mtime ("last used": written, or touched when an upload deduped against it or a shard named it)
is older than the grace period, and this process has seen it unreferenced for that long.
Nothing is stored for this: references are recomputed from the index each pass, so it works
on existing data dirs. After a restart a xorb waits one more grace period.

Races: xorb stores and shard acceptance hold ``State.xorb_guard`` shared; a collection batch
holds it exclusively while it re-checks and deletes, so a shard either sees its xorb (and has
touched it, which protects it) or gets the usual 400 "references unknown xorb". Dead
reconstructions that used a dropped xorb are dropped with it, so an ``addFile`` by their hash
is refused instead of committing a file that cannot be read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass

from .https import admin_open
from .state import State

log = logging.getLogger("kvbucket.emulator")

#: Default grace period: hf_xet's local shard cache lifetime (3 weeks) plus a day of margin.
DEFAULT_XORB_GRACE_S = 22 * 24 * 3600.0
#: Xorbs deleted per exclusive section: each batch blocks xorb/shard uploads for a few ms only.
BATCH = 64


@dataclass
class Collected:
    xorbs: int = 0
    bytes: int = 0
    reconstructions: int = 0
    unreferenced_kept: int = 0  # unreferenced, still within the grace period

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


class XorbCollector:
    """Finds and drops unreferenced xorbs of one ``State``; one pass at a time."""

    def __init__(self, state: State, grace_s: float = DEFAULT_XORB_GRACE_S) -> None:
        if grace_s < 0:
            raise ValueError("the xorb grace period must be >= 0 seconds")
        self.state = state
        self.grace_s = grace_s
        self._unref_since: dict[str, float] = {}  # xorb -> when a pass first saw it unreferenced
        self._pass = threading.Lock()

    def _live_and_all(self) -> tuple[set[str], list[str]]:
        st = self.state
        with st._lock:
            live = {r[0] for r in st._db.execute(
                "SELECT DISTINCT json_extract(s.value, '$[0]') FROM files AS f"
                " JOIN reconstructions AS r ON r.file_hash = f.xet_hash, json_each(r.segments) AS s"
            )}  # fmt: skip
            every = [r[0] for r in st._db.execute("SELECT hash FROM xorbs")]
        return live, every

    def _dead_uses(self, wanted: set[str]) -> dict[str, list[str]]:
        """xorb -> the reconstructions no file holds that use it (they go with the xorb)."""
        st = self.state
        with st._lock:
            rows = st._db.execute(
                "SELECT r.file_hash, r.segments FROM reconstructions AS r"
                " WHERE NOT EXISTS (SELECT 1 FROM files AS f WHERE f.xet_hash = r.file_hash)"
            ).fetchall()
        uses: dict[str, list[str]] = {}
        for file_hash, segs in rows:
            for x in {s[0] for s in json.loads(segs)} & wanted:
                uses.setdefault(x, []).append(file_hash)
        return uses

    def _mtime(self, xorb_hex: str) -> float | None:
        try:
            return os.stat(self.state.xorb_path(xorb_hex)).st_mtime
        except FileNotFoundError:
            return None

    def collect(self, grace_s: float | None = None, budget_s: float = 60.0) -> Collected:
        """One pass; ``grace_s`` overrides the configured grace (0: everything unreferenced now).
        Stops after ``budget_s`` of deleting; the next pass goes on."""
        grace = self.grace_s if grace_s is None else grace_s
        with self._pass:
            return self._collect(grace, budget_s)

    def _collect(self, grace: float, budget_s: float) -> Collected:
        out = Collected()
        started = time.time()
        cutoff = started - grace  # used before this: not used since (a use touches the mtime)
        live, every = self._live_and_all()
        unref = [x for x in every if x not in live]
        self._unref_since = {x: self._unref_since.get(x, started) for x in unref}
        eligible = []
        for x in unref:
            m = self._mtime(x)
            if self._unref_since[x] <= cutoff and (m is None or m <= cutoff):
                eligible.append(x)
            else:
                out.unreferenced_kept += 1
        if not eligible:
            return out
        uses = self._dead_uses(set(eligible))
        deadline = time.monotonic() + budget_s
        for i in range(0, len(eligible), BATCH):
            if time.monotonic() > deadline:
                out.unreferenced_kept += len(eligible) - i
                break
            self._drop_batch(eligible[i : i + BATCH], uses, cutoff, out)
        if out.xorbs:
            log.info(
                "collected %d unreferenced xorbs (%d bytes, %d dead reconstructions)",
                out.xorbs,
                out.bytes,
                out.reconstructions,
            )
        return out

    def _drop_batch(
        self, batch: list[str], uses: dict[str, list[str]], cutoff: float, out: Collected
    ) -> None:
        st = self.state
        with st.xorb_guard.exclusive():
            doomed = self._unindex(batch, uses, cutoff, out)
            for x in doomed:  # after the commit: a crash leaves a stray file, never a dangling row
                path = st.xorb_path(x)
                try:
                    size = path.stat().st_blocks * 512
                    path.unlink()
                except FileNotFoundError:
                    size = 0
                out.xorbs += 1
                out.bytes += size
                self._unref_since.pop(x, None)

    def _unindex(
        self, batch: list[str], uses: dict[str, list[str]], cutoff: float, out: Collected
    ) -> list[str]:
        """Drop the index rows of the batch's xorbs still unused, in one commit; their hashes."""
        st = self.state
        doomed: list[str] = []
        with st.transaction():
            for x in batch:
                m = self._mtime(x)
                recs = uses.get(x, [])
                if m is not None and m > cutoff:  # a shard or an upload used it since the scan
                    out.unreferenced_kept += 1
                    continue
                if (
                    recs
                    and st._db.execute(
                        "SELECT 1 FROM json_each(?) AS h JOIN files AS f ON f.xet_hash = h.value LIMIT 1",
                        (json.dumps(recs),),
                    ).fetchone()
                ):  # an addFile committed one of its files since the scan
                    out.unreferenced_kept += 1
                    continue
                for h in recs:
                    out.reconstructions += st._db.execute(
                        "DELETE FROM reconstructions WHERE file_hash = ?", (h,)
                    ).rowcount
                    st._db.execute("DELETE FROM uploads WHERE file_hash = ?", (h,))
                st._db.execute("DELETE FROM xorbs WHERE hash = ?", (x,))
                st._xorb_cache.pop(x, None)
                doomed.append(x)
        return doomed


def collect_now(
    endpoint: str, admin_key: str, grace_s: float | None = None, ca: str | os.PathLike[str] | None = None
) -> dict[str, int]:
    """Ask a running emulator to collect now (``POST /_emulator/gc``); what it collected.
    ``ca``: the CA an ``https://`` emulator's certificate chains to."""
    query = "" if grace_s is None else f"?grace={grace_s:g}"
    req = urllib.request.Request(f"{endpoint}/_emulator/gc{query}", data=b"", method="POST")
    req.add_header("X-Emulator-Admin", admin_key)
    with admin_open(req, 660, ca) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]
