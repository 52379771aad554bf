"""Stress: threads put, get and remove overlapping keys for a bounded time, per backend.

Each put writes a new *version* of a key: a 16-byte header (key index, version) followed by a
pattern derived from both, so a torn or mixed-up chunk is detected on every read. Every
operation's start and end are recorded; at the end every key must read back as a version that
could legitimately be the last one (no older version resurrected, no acknowledged chunk lost
unless it was removed or evicted), and the byte bounds of bounded tiers must never have been
exceeded (``peak_bytes`` is updated under the tiers' locks).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbucket.backends.base import StorageBackend
from kvbucket.backends.hybrid import HybridBackend
from kvbucket.backends.local_cpu import LocalCPUBackend
from kvbucket.backends.local_disk import LocalDiskBackend
from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
from kvbucket.chunks import KVLayout, as_view
from kvbucket.stores.local.file import FileStore
from kvbucket.testing.backend_tests import key

LAYOUT = KVLayout(2, 2, 32, "bfloat16", chunk_tokens=32)  # 16 KiB chunks
FULL = LAYOUT.full_chunk_bytes
SECONDS = 1.5
THREADS = 4
NKEYS = 16
CAPACITY = 6 * FULL  # bounded tiers hold fewer chunks than there are keys: evictions happen


def make_chunk(k: int, version: int) -> bytes:
    pattern = np.frombuffer(hashlib.blake2b(struct.pack("<qq", k, version)).digest(), dtype=np.uint8)
    body = np.tile(pattern, (FULL - 16) // 64 + 1)[: FULL - 16]
    return struct.pack("<qq", k, version) + body.tobytes()


@dataclass
class Op:
    kind: str  # "put" or "remove"
    version: int
    start: float
    end: float = math.inf  # a non-blocking put may land any time until the final flush


@dataclass
class History:
    ops: dict[int, list[Op]] = field(default_factory=lambda: defaultdict(list))
    versions: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check_read(self, k: int, chunk: Any) -> None:
        data = as_view(chunk).tobytes()
        kk, version = struct.unpack("<qq", data[:16])
        assert kk == k, f"read key {k} and got a chunk of key {kk}"
        with self.lock:
            known = version in self.versions[k]
        assert known, f"key {k}: version {version} was never put"
        assert data == make_chunk(k, version), f"key {k} version {version}: bytes differ (torn or mixed)"


def hammer(backend: StorageBackend, history: History, seed: int, stop: float, errors: list[BaseException],
           counter: Iterator[int]) -> None:
    rnd = random.Random(seed)
    try:
        while time.monotonic() < stop:
            k = rnd.randrange(NKEYS)
            r = rnd.random()
            if r < 0.35:
                blocking = rnd.random() < 0.7
                version = next(counter)
                with history.lock:
                    history.versions[k].add(version)
                op = Op("put", version, time.monotonic())
                backend.put(key(k), make_chunk(k, version), blocking=blocking)
                if blocking:
                    op.end = time.monotonic()
                with history.lock:
                    history.ops[k].append(op)
            elif r < 0.45:
                op = Op("remove", -1, time.monotonic())
                backend.remove(key(k))
                op.end = time.monotonic()
                with history.lock:
                    history.ops[k].append(op)
            elif r < 0.85:
                got = backend.get(key(k))
                if got is not None:
                    history.check_read(k, got)
            elif r < 0.95:
                ks = [rnd.randrange(NKEYS) for _ in range(5)]
                for kk, got in zip(ks, backend.batched_get([key(x) for x in ks]), strict=True):
                    if got is not None:
                        history.check_read(kk, got)
            else:
                backend.contains(key(k))
    except BaseException as e:
        errors.append(e)


def run_stress(backend: StorageBackend, evicted: set[str], bounded: list[Any]) -> History:
    history = History()
    errors: list[BaseException] = []
    counter = itertools.count(1)
    stop = time.monotonic() + SECONDS
    threads = [threading.Thread(target=hammer, args=(backend, history, s, stop, errors, counter))
               for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.flush().pending == 0  # every queued put finished (none waited out the flush bound)
    assert not errors, errors[0]
    total_ops = sum(len(v) for v in history.ops.values())
    assert total_ops > 50, f"only {total_ops} writes in {SECONDS}s: the stress did not stress"

    for k in range(NKEYS):
        ops = history.ops.get(k, [])
        got = backend.get(key(k))
        puts = [o for o in ops if o.kind == "put"]
        if not puts:
            assert got is None, f"key {k} was never put but reads back"
            continue
        last = max(puts, key=lambda o: o.start)
        allowed = {o.version for o in puts if o.end >= last.start}
        removed_after = [o for o in ops if o.kind == "remove" and o.end >= last.start]
        if got is None:
            assert key(k).to_string() in evicted or removed_after, (
                f"key {k}: acknowledged version {last.version} lost (not removed, not evicted)")
            continue
        history.check_read(k, got)
        version = struct.unpack("<qq", as_view(got)[:16].tobytes())[1]
        assert version in allowed, f"key {k}: read version {version}, but only {sorted(allowed)} can be last"
        after_all = [o for o in ops if o.kind == "remove" and o.start > max(p.end for p in puts)]
        assert not after_all, f"key {k} was removed after its last put but still reads back"

    for tier in bounded:
        assert tier.peak_bytes <= tier.max_bytes, f"{tier!r} held {tier.peak_bytes} bytes"
        assert tier.used_bytes <= tier.max_bytes
    return history


def test_stress_local_cpu() -> None:
    evicted: set[str] = set()
    with LocalCPUBackend(CAPACITY, queue_size=4, on_evict=evicted.add) as b:
        run_stress(b, evicted, [b])
        assert b.evictions > 0  # the bound was exercised


def test_stress_local_disk(tmp_path: Path) -> None:
    evicted: set[str] = set()
    with LocalDiskBackend(tmp_path / "disk", CAPACITY, queue_size=4, on_evict=evicted.add) as b:
        run_stress(b, evicted, [b])
        assert b.evictions > 0
        listed = set(b.list())
    with LocalDiskBackend(tmp_path / "disk", CAPACITY) as again:  # the index agrees with the files
        assert set(again.list()) == listed


@pytest.mark.parametrize("cls", [RemoteBackend, PipelinedRemoteBackend])
def test_stress_remote(tmp_path: Path, cls: Callable[..., RemoteBackend]) -> None:
    with cls(FileStore(tmp_path / "remote"), LAYOUT, queue_size=4) as b:
        run_stress(b, set(), [])


def test_stress_hybrid(tmp_path: Path) -> None:
    cpu = LocalCPUBackend(CAPACITY)
    disk = LocalDiskBackend(tmp_path / "disk", CAPACITY)
    remote = PipelinedRemoteBackend(FileStore(tmp_path / "remote"), LAYOUT, pipeline_batch=2)
    with HybridBackend([cpu, disk, remote]) as h:
        run_stress(h, set(), [cpu, disk])  # the remote tier is unbounded: nothing may be lost
        assert sum(h.hits[1:]) > 0  # reads went below the memory tier, so promotion was exercised
