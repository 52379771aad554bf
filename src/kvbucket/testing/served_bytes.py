"""The served-bytes invariant at random moments: a model-based check (issue 29).

*Every ``found`` result carries exactly the bytes stored last before the load began, or the bytes
of a write that overlapped the load; everything else is a miss* (docs/integrity.md, "Every byte
served is the byte verified"). :func:`run_cell` drives a :class:`RemoteBackend` over a real store
(sealed or encrypted, read-ahead on or off) the way zarr-python's stateful tests drive a store
against a dict model: random operations, here from several threads at once so that loads arrive
at random moments relative to their lookup (which starts a read-ahead), the read-ahead itself,
its decryption (slowed at random by :func:`decryption_jitter`), and a put or delete of the same
name. The model is the history of writes with their start and end instants; each load is checked
against it when the round ends.

With ``damage`` (issue 39), the writer of a lane also damages objects in storage (a flipped
payload bit, written behind the tier's back) and evicts them (by the version a HEAD saw, after a
random pause), and reads cross a bad wire (:class:`~kvbucket.testing.delete_races.WireDamage`):
a load must still serve only allowed bytes, and after every round each name whose last event was
a good put must still be stored (no valid chunk deleted: a refusal removes only what it read
damaged twice, by version; an eviction only the version it saw), once the writers' re-checks ran
(on the Hub a delete can take a write committed in its compare-to-delete window; the writer adds
it back: those are counted as ``readded``).

A store call that fails (past its deadline on a starved machine, its breaker open) ends that
lookup, load, damage or eviction as a miss or a no-op, counted in ``timed_out`` (the store's
deadline) or ``failed``; it never ends a worker thread (whose later loads would then go uncounted).

The plan (names, operations, delays, payloads, keys) comes from the seed and is reproducible;
which thread runs first is the machine's. A failure names the seed, the cell and the round, with
the history of that name, so it can be replayed (``KVBUCKET_SERVED_SEED``).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbucket.backends.remote import RemoteBackend
from kvbucket.chunks import KVLayout, as_view
from kvbucket.encryption import Keyring
from kvbucket.errors import DeadlineExceededError, StoreError
from kvbucket.keys import CacheEngineKey, as_key_string
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.read_ahead_config import ReadAheadSettings

#: Rounds per cell and the seed (``make test`` runs the defaults; a long run raises the rounds).
ROUNDS_ENV, SEED_ENV = "KVBUCKET_SERVED_ROUNDS", "KVBUCKET_SERVED_SEED"
CHUNK_ENV = "KVBUCKET_SERVED_CHUNK_KIB"
DEFAULT_ROUNDS, DEFAULT_SEED, DEFAULT_CHUNK_KIB = 24, 29, 256
LANES = 3  # reader/writer pairs at once, each on names of its own (writes of one name never overlap)
NAMES_PER_LANE = 2


def settings_from_env() -> tuple[int, int, int]:
    """(rounds per cell, seed, chunk KiB) from the environment, else the ``make test`` defaults."""
    return (int(os.environ.get(ROUNDS_ENV, DEFAULT_ROUNDS)), int(os.environ.get(SEED_ENV, DEFAULT_SEED)),
            int(os.environ.get(CHUNK_ENV, DEFAULT_CHUNK_KIB)))


def layout_of(chunk_kib: int) -> KVLayout:
    """A layout whose full chunk is ``chunk_kib`` KiB (a multiple of 2 KiB)."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="bfloat16",
                    chunk_tokens=max(1, chunk_kib * 1024 // 256))


@dataclass
class Write:
    key: int
    value: bytes | None  # None: a delete
    start: float
    end: float = float("inf")  # still running
    ok: bool = True


@dataclass
class Load:
    key: int
    start: float
    end: float
    got: bytes | None
    how: str  # what came before it ("lookup+0.003s", "no lookup") and how it loaded


@dataclass
class Tally:
    loads: int = 0
    found: int = 0
    wrong: list[str] = field(default_factory=list)
    valid_deleted: list[str] = field(default_factory=list)  # with damage: good chunks gone
    readded: int = 0  # with damage: good chunks gone after a round, added back by the writer's re-check
    damaged: int = 0  # objects damaged in storage (with damage)
    evicted: int = 0  # evictions that removed the version they saw (with damage)
    evictions_kept: int = 0  # evictions that found another version (with damage)
    wire_flipped: int = 0  # reads damaged on the wire (with damage)
    timed_out: int = 0  # lookups, loads, writes, damage, evictions past a store deadline (misses, no-ops)
    failed: int = 0  # the same ended by another store error (the breaker open, an error answer)

    def add(self, other: Tally) -> None:
        self.loads += other.loads
        self.found += other.found
        self.wrong.extend(other.wrong)
        self.valid_deleted.extend(other.valid_deleted)
        self.readded += other.readded
        self.damaged += other.damaged
        self.evicted += other.evicted
        self.evictions_kept += other.evictions_kept
        self.wire_flipped += other.wire_flipped
        self.timed_out += other.timed_out
        self.failed += other.failed


class Outcomes:
    """Store failures the harness met, from every thread: each one a miss or a no-op, counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.timed_out = 0
        self.failed = 0

    def note(self, err: BaseException, n: int = 1) -> None:
        with self._lock:
            if isinstance(err, DeadlineExceededError):
                self.timed_out += n
            else:
                self.failed += n


class _CountingBackend(RemoteBackend):
    """The tier answers a key whose lookup or load the store failed as a miss; this counts those
    (deadlines apart), so a starved run says how many of its misses were timeouts."""

    outcomes: Outcomes

    def _lookup_failed(self, n: int, err: Exception) -> None:
        self.outcomes.note(err, n)
        super()._lookup_failed(n, err)

    def _read_failed(self, key: str, err: Exception) -> None:
        self.outcomes.note(err)
        super()._read_failed(key, err)


def allowed(writes: list[Write], load: Load) -> list[bytes]:
    """The byte strings ``load`` may return: the last write done before it began, every write that
    overlapped it, and any failed write begun before it ended (it may have landed)."""
    ok_before = [w for w in writes if w.ok and w.end < load.start]
    out = [ok_before[-1].value] if ok_before and ok_before[-1].value is not None else []
    for w in writes:
        overlaps = w.start < load.end and w.end > load.start
        if w.value is not None and (overlaps or (not w.ok and w.start < load.end)):
            out.append(w.value)
    return out


@contextlib.contextmanager
def decryption_jitter(rng: random.Random, max_secs: float = 0.004) -> Iterator[None]:
    """Hold in-place decryption a random moment (half of the time) before it starts: a load then
    arrives while a read-ahead is being decrypted as often as before or after it."""
    from kvbucket.stores.guard import envelope_open
    real = envelope_open.decrypt_in_place
    lock = threading.Lock()

    def slowed(*args: Any, **kw: Any) -> None:
        with lock:
            pause = rng.random() * max_secs if rng.random() < 0.5 else 0.0
        if pause:
            time.sleep(pause)
        real(*args, **kw)

    envelope_open.decrypt_in_place = slowed  # type: ignore[assignment]
    try:
        yield
    finally:
        envelope_open.decrypt_in_place = real


def _delay(rng: random.Random) -> float:
    """A moment: at once, within a millisecond, within 10 ms, or within 60 ms (a quarter each)."""
    return (0.0, rng.random() * 0.001, rng.random() * 0.01, rng.random() * 0.06)[rng.randrange(4)]


class _Lane:
    """One reader and one writer on the names of this lane, round after round."""

    def __init__(self, backend: RemoteBackend, lane: int, seed: int, layout: KVLayout,
                 raw: ObjectStore | None = None, outcomes: Outcomes | None = None) -> None:
        self.backend = backend
        self.outcomes = outcomes or Outcomes()
        self.raw = raw  # with damage: the store itself (damage at rest goes behind the tier's back)
        self.last: dict[int, str] = {}  # with damage: each name's last event (put, failed, gone, damaged)
        self.tally = Tally()
        self.rng = random.Random(seed * 1_000_003 + lane)
        self.keys = [lane * NAMES_PER_LANE + j for j in range(NAMES_PER_LANE)]
        self.layout = layout
        self.writes: dict[int, list[Write]] = {k: [] for k in self.keys}
        self.loads: list[Load] = []
        self.serial = 0

    def value(self) -> bytes:
        self.serial += 1
        return np.random.default_rng(self.rng.getrandbits(63)).integers(
            0, 256, self.layout.full_chunk_bytes, dtype=np.uint8).tobytes()

    def write(self, k: int, value: bytes | None) -> None:
        w = Write(k, value, time.monotonic())
        self.writes[k].append(w)
        try:
            if value is None:
                self.backend.remove(ckey(k))
            else:
                w.ok = self.backend.batched_put([(ckey(k), value)]) == 1
        except Exception as e:  # failed: it may still have landed (allowed() counts it possible)
            self._failed(e)
            w.ok = False
        w.end = time.monotonic()
        self.last[k] = "failed" if not w.ok else "gone" if value is None else "put"

    def name(self, k: int) -> str:
        return self.backend._name(as_key_string(ckey(k)))

    def damage_at_rest(self, k: int) -> None:
        """Flip a payload bit of ``k``'s object in storage (behind the tier: a new version there)."""
        from kvbucket.testing.delete_races import damage

        assert self.raw is not None
        try:
            damage(self.raw, self.name(k))
        except ValueError:  # nothing stored to damage
            return
        except StoreError as e:  # its read or write failed; the damaged bytes may have landed
            self.outcomes.note(e)
            self.last[k] = "damaged"  # so the name need not be stored after the round
            return
        self.last[k] = "damaged"
        self.tally.damaged += 1

    def evict(self, k: int, pause: float) -> None:
        """Evict ``k`` by the version a HEAD sees, after ``pause`` (a reader or refusal may run)."""
        from kvbucket.stores.guard.refusals import delete_as_seen

        name = self.name(k)
        (h,) = self.backend.reads.head_many([name])
        if h.error is not None:
            self.outcomes.note(h.error)
        if not h.found or h.version is None:
            return
        time.sleep(pause)
        w = Write(k, None, time.monotonic())
        try:
            r = delete_as_seen(self.backend.reads, [name], {name: h.version}, "eviction").get(name)
        except StoreError as e:  # it may have removed the version: the name need not be stored
            self.outcomes.note(e)
            self.last[k] = "failed"
            return
        w.end = time.monotonic()
        self.backend._invalidate([name])
        if r is not None and r.ok and getattr(r, "removed", False):
            self.writes[k].append(w)
            self.last[k] = "gone"
            self.tally.evicted += 1
        elif r is not None and getattr(r, "changed", False):
            self.tally.evictions_kept += 1

    def write_all(self) -> None:
        """New bytes for every name of the lane in one batch (stored back to back, so a batched
        load of them reads them as a run: stores/hub/xet/reads.py)."""
        values = [self.value() for _ in self.keys]
        ws = [Write(k, v, time.monotonic()) for k, v in zip(self.keys, values, strict=True)]
        for w in ws:
            self.writes[w.key].append(w)
        try:
            results = self.backend.batched_put_results(list(zip(map(ckey, self.keys), values, strict=True)))
            for w, r in zip(ws, results, strict=True):
                w.ok = r is None
        except Exception as e:  # failed: any of them may still have landed
            self._failed(e)
            for w in ws:
                w.ok = False
        end = time.monotonic()
        for w in ws:
            w.end = end
            self.last[w.key] = "put" if w.ok else "failed"

    def load_all(self, how: str) -> None:
        """Every name of the lane in one batched load (a run where they sit back to back)."""
        t0 = time.monotonic()
        try:
            chunks: list[Any] = self.backend.batched_get([ckey(k) for k in self.keys])
        except StoreError as e:  # every key a miss (the tier answers them so itself; never lost)
            self.outcomes.note(e, len(self.keys))
            chunks, how = [None] * len(self.keys), f"{how}, failed: {type(e).__name__}"
        t1 = time.monotonic()
        for k, chunk in zip(self.keys, chunks, strict=True):
            self.loads.append(Load(k, t0, t1, None if chunk is None else as_view(chunk).tobytes(), how))

    def round(self, start: threading.Barrier) -> tuple[Callable[[], None], Callable[[], None]]:
        """The two halves of one round (planned here, from the seed), run by two threads."""
        rng = self.rng
        k = rng.choice(self.keys)
        wdelay = _delay(rng)
        wvalue = None if rng.random() < 0.3 else self.value()
        do_write = rng.random() < 0.85
        lookup = rng.random() < 0.8
        ldelay, gdelay = _delay(rng), _delay(rng)
        into = rng.random() < 0.5
        second = rng.random() < 0.3
        together = rng.random() < 0.25  # the writer rewrites the lane in one batch, the reader loads it so
        # With damage (drawn only then: the plans of runs without it stay as they were): damage at
        # rest (< 0.2) or an eviction (< 0.3) after a pause, then half of the time a rewrite.
        spoil, epause, rewrite_after = 1.0, 0.0, False
        if self.raw is not None:
            spoil, epause = rng.random(), rng.random() * 0.004
            rewrite_after = rng.random() < 0.5 and do_write and wvalue is not None

        def writer() -> None:
            start.wait()
            if spoil < 0.3:
                time.sleep(wdelay)
                if spoil < 0.2:
                    self.damage_at_rest(k)
                else:
                    self.evict(k, epause)
                if rewrite_after:
                    self.write(k, wvalue)
            elif do_write:
                time.sleep(wdelay)
                if together:
                    self.write_all()
                else:
                    self.write(k, wvalue)

        def reader() -> None:
            start.wait()
            time.sleep(ldelay)
            how = "no lookup"
            if lookup:
                try:
                    self.backend.contains(ckey(k))  # a hit starts the read-ahead
                except StoreError as e:  # a miss (the tier answers it so itself)
                    self.outcomes.note(e)
                how = f"lookup+{gdelay:.4f}s"
                time.sleep(gdelay)
            if together:
                self.load_all(f"{how}, batched get of the lane")
                return
            for n in range(2 if second else 1):
                self.load(k, f"{how}, {'get_into' if into else 'get'}{' again' if n else ''}", into)

        return writer, reader

    def load(self, k: int, how: str, into: bool) -> None:
        t0 = time.monotonic()
        got: bytes | None = None
        try:
            if into:
                buf = np.empty(self.layout.full_chunk_bytes, dtype=np.uint8)
                got = buf.tobytes() if self.backend.get_into(ckey(k), buf) else None
            else:
                chunk = self.backend.get(ckey(k))
                got = None if chunk is None else as_view(chunk).tobytes()
        except StoreError as e:  # a miss (the tier answers it so itself), counted
            self.outcomes.note(e)
            how = f"{how}, failed: {type(e).__name__}"
        self.loads.append(Load(k, t0, time.monotonic(), got, how))

    def _failed(self, err: Exception) -> None:
        if isinstance(err, StoreError):
            self.outcomes.note(err)

    def check_stored(self, cell: str, seed: int, rnd: int) -> None:
        """With damage, after a round (nothing running): a name whose last event was a good put
        is still stored."""
        if self.raw is None:
            return
        from kvbucket.testing.delete_races import settle_writes

        good = [k for k in self.keys if self.last.get(k) == "put"]
        heads = self.raw.head_many([self.name(k) for k in good])
        gone = [k for k, h in zip(good, heads, strict=True) if h.ok and h.size is None]
        if gone:  # a Hub writer's re-check may add them back
            settle_writes(self.raw)
            heads = self.raw.head_many([self.name(k) for k in gone])
            self.tally.readded += sum(1 for h in heads if h.ok and h.size is not None)
            good = gone
        for k, h in zip(good, heads, strict=True):
            if h.ok and h.size is None:
                self.last[k] = "lost"  # counted once (not again each round until it is rewritten)
                self.tally.valid_deleted.append(f"{cell} seed={seed} round={rnd} key={k}: a good chunk was "
                                                "deleted")

    def check(self, cell: str, seed: int, rnd: int) -> Tally:
        self.check_stored(cell, seed, rnd)
        t, self.tally = self.tally, Tally()
        for ld in self.loads:
            t.loads += 1
            if ld.got is None:
                continue
            t.found += 1
            ok = allowed(self.writes[ld.key], ld)
            if ld.got not in ok:
                hist = "; ".join(
                    f"{'delete' if w.value is None else 'put'}[{w.start:.4f}..{w.end:.4f}"
                    f"{'' if w.ok else ' failed'}]"
                    f"{'' if w.value is None or w.value not in ok else ' (allowed)'}"
                    f"{' <- these bytes' if w.value is not None and w.value == ld.got else ''}"
                    for w in self.writes[ld.key])
                t.wrong.append(f"{cell} seed={seed} round={rnd} key={ld.key}: a load [{ld.start:.4f}.."
                               f"{ld.end:.4f}] ({ld.how}) found bytes that are not allowed; writes: {hist}")
        self.loads.clear()
        for k, ws in self.writes.items():  # later loads may only get the last good write or newer
            done = [i for i, w in enumerate(ws) if w.ok]
            self.writes[k] = ws[done[-1]:] if done else ws
        return t


def ckey(k: int) -> CacheEngineKey:
    return CacheEngineKey("served/model", 1, 0, 1000 + k, "bfloat16")


def run_cell(store: ObjectStore, *, encrypted: bool, read_ahead: bool, rounds: int, seed: int,
             chunk_kib: int = DEFAULT_CHUNK_KIB, cell: str = "", damage: float = 0.0) -> Tally:
    """``rounds`` rounds on each of :data:`LANES` lanes through a :class:`RemoteBackend` over
    ``store`` (which stays open); every load checked against the history (see the module).
    ``damage`` > 0: damage in storage, eviction, and that share of reads damaged on the wire."""
    from kvbucket.testing.delete_races import WireDamage

    raw = store if damage else None
    if damage:
        store = WireDamage(store, damage, seed)
    rng = random.Random(seed)
    layout = layout_of(chunk_kib)
    keyring = Keyring({"*": {1: rng.randbytes(32)}}) if encrypted else None
    settings = ReadAheadSettings(True, 64 * layout.full_chunk_bytes, 10.0) if read_ahead else None
    cell = cell or f"encrypted={encrypted} read_ahead={read_ahead}"
    total = Tally()
    prefix = f"served-{seed}-{int(encrypted)}{int(read_ahead)}{'d' if damage else ''}"
    outcomes = Outcomes()
    with _CountingBackend(store, layout, encryption=keyring, read_ahead=settings, owns_store=False,
                          prefix=prefix) as backend, decryption_jitter(random.Random(seed + 1)):
        backend.outcomes = outcomes
        lanes = [_Lane(backend, i, seed, layout, raw, outcomes) for i in range(LANES)]
        for lane in lanes:  # every name starts stored, the lane's names in one batch
            lane.write_all()
        for rnd in range(rounds):
            start = threading.Barrier(2 * LANES)
            died: list[str] = []
            threads = [threading.Thread(target=_reporting(half, died), name=f"served-{i}")
                       for i, lane in enumerate(lanes) for half in lane.round(start)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)
            assert not any(th.is_alive() for th in threads), f"{cell}: round {rnd} did not end in 120 s"
            assert not died, f"{cell} seed={seed} round={rnd}: a worker thread died: {died}"
            for lane in lanes:
                total.add(lane.check(cell, seed, rnd))
    if isinstance(store, WireDamage):
        total.wire_flipped = store.flipped
    total.timed_out, total.failed = outcomes.timed_out, outcomes.failed
    return total


def _reporting(half: Callable[[], None], died: list[str]) -> Callable[[], None]:
    """``half`` whose unexpected exception is kept for the round to fail on (a thread's own
    exception is only printed: the run would go on without that thread's loads)."""

    def run() -> None:
        try:
            half()
        except BaseException as e:
            died.append(f"{threading.current_thread().name}: {type(e).__name__}: {e}")
            raise

    return run


__all__ = ["DEFAULT_ROUNDS", "DEFAULT_SEED", "ROUNDS_ENV", "SEED_ENV", "Outcomes", "Tally", "allowed",
           "decryption_jitter", "run_cell", "settings_from_env"]
