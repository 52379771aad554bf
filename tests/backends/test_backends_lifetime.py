"""Process lifetime: no kvbucket thread keeps a process alive, and ``close()`` waits a bounded time.

Each scenario runs in a subprocess whose store call never returns (a blocking fake, or a real
S3 client against a loopback server that accepts connections and never answers); the test
asserts the script's answer and that the process exits within a bound (real: ~1-6 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvbucket.backends._putqueue import PutQueue
from kvbucket.threads import DaemonThreadPool

SRC = str(Path(__file__).resolve().parents[2] / "src")
EXIT_BOUND_SECS = 30.0  # generous: the scripts below end in about 1-6 s

_PRELUDE = textwrap.dedent(
    """
    import socket, sys, threading, time
    import numpy as np
    from kvbucket.backends.remote import PipelinedRemoteBackend, RemoteBackend
    from kvbucket.backends.hybrid import HybridBackend
    from kvbucket.backends.local_cpu import LocalCPUBackend
    from kvbucket.chunks import KVLayout
    from kvbucket.errors import TransientStoreError
    from kvbucket.stores.local.memory import MemoryStore

    LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float16", chunk_tokens=4)
    FULL = LAYOUT.full_chunk_bytes

    class HungStore(MemoryStore):
        '''Every call blocks forever, like a client stuck on a server that never answers.'''
        def _hang(self, *a, **k):
            threading.Event().wait()
        put_many = get_many = head_many = delete_many = _hang

    def silent_server():
        '''A loopback server that accepts connections and never answers.'''
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        held = []
        def accept():
            while True:
                held.append(srv.accept()[0])
        threading.Thread(target=accept, daemon=True).start()
        return srv.getsockname()[1]

    def timed(what, fn):
        t0 = time.monotonic()
        try:
            out = fn()
            print(what, "answered %r after %.1f" % (out, time.monotonic() - t0), flush=True)
        except TransientStoreError:
            print(what, "timed out after %.1f" % (time.monotonic() - t0), flush=True)
    """
)

SCENARIOS = {
    "remote-get": """
        b = RemoteBackend(HungStore(), LAYOUT, blocking_timeout_secs=1)
        timed("get", lambda: b.batched_get(["k"]))
        b.close()
    """,
    "remote-contains-no-close": """
        b = RemoteBackend(HungStore(), LAYOUT, blocking_timeout_secs=1)
        timed("contains", lambda: b.contains("k"))
        # no close(): the interpreter must still exit
    """,
    "pipelined-get": """
        b = PipelinedRemoteBackend(HungStore(), LAYOUT, blocking_timeout_secs=1, pipeline_batch=1)
        timed("get", lambda: b.batched_get(["a", "b", "c"]))
        b.close()
    """,
    "queued-puts-close": """
        b = RemoteBackend(HungStore(), LAYOUT, blocking_timeout_secs=1, queue_size=4)
        for i in range(3):
            b.put(f"k{i}", np.zeros(FULL, np.uint8), blocking=False)
        t0 = time.monotonic()
        b._queue.close(drain_timeout_secs=2)  # what close() does, with a short bound
        b.close()
        print("closed in %.1f" % (time.monotonic() - t0), flush=True)
    """,
    "hybrid-put-close": """
        cpu = LocalCPUBackend(1 << 20)
        h = HybridBackend([cpu, RemoteBackend(HungStore(), LAYOUT, blocking_timeout_secs=1)])
        out = h.batched_put_results([("k", np.zeros(FULL, np.uint8))])
        print("put", type(out[0]).__name__, flush=True)
        h.close()
    """,
    "s3-silent-server": """
        from kvbucket.stores.s3.store import S3Store
        from kvbucket.stores.s3.config import S3Config
        port = silent_server()
        store = S3Store(S3Config(
            s3_endpoint="s3://bucket", s3_endpoint_url=f"http://127.0.0.1:{port}", s3_region="us-east-1",
            aws_access_key_id="AKIAEXAMPLE", aws_secret_access_key="not-a-secret",
        ))
        b = RemoteBackend(store, LAYOUT, blocking_timeout_secs=1)
        timed("get", lambda: b.batched_get(["k"]))
        timed("contains", lambda: b.batched_contains(["k"]))
        b.close()
    """,
    "hf-silent-server": """
        from kvbucket.stores.hub.store import HFBucketStore
        from kvbucket.stores.hub.config import build_config
        port = silent_server()
        store = HFBucketStore(build_config(
            bucket_handle="hf://buckets/someone/cache", endpoint=f"http://127.0.0.1:{port}",
            token="hf_notarealtokenatallxxxxxxxxxxxxxxx", token_env="", max_retries=0,
        ))
        b = RemoteBackend(store, LAYOUT, blocking_timeout_secs=1)
        timed("get", lambda: b.batched_get(["k"]))
        timed("put", lambda: b.put("k", np.zeros(FULL, np.uint8)))
        t0 = time.monotonic()
        b.close()
        print("closed in %.1f" % (time.monotonic() - t0), flush=True)
    """,
    "l2-adapter-close": """
        from kvbucket.keys import ObjectKey
        from kvbucket.l2 import ObjectStoreL2Adapter
        a = ObjectStoreL2Adapter(
            HungStore(), rebuild_usage=False, delete_timeout_secs=1, full_chunk_bytes=FULL
        )
        tid = a.submit_lookup_and_lock_task([ObjectKey("m", 1, (7).to_bytes(8, "big"), "")])
        time.sleep(0.5)
        print("answer", a.query_lookup_and_lock_result(tid), flush=True)
        t0 = time.monotonic()
        a.close()
        print("closed in %.1f" % (time.monotonic() - t0), flush=True)
    """,
}

EXPECTED = {
    "remote-get": ["get answered [None] after 1."],  # a read of a hung store is a miss
    "remote-contains-no-close": ["contains answered False after 1."],
    "pipelined-get": ["get answered [None, None, None] after 1."],  # one bound for the whole read
    "queued-puts-close": ["closed in "],
    "hybrid-put-close": ["put TierPutError"],
    "s3-silent-server": ["get answered [None] after 1.", "contains answered [False] after 1."],
    "hf-silent-server": ["get answered [None] after 1.", "put timed out after 1.", "closed in "],
    "l2-adapter-close": ["answer None", "closed in "],
}


#: a scenario's run: its process (None: it did not exit in time), its seconds, its output
Ran = tuple[subprocess.CompletedProcess[str] | None, float, str]


def _run_scenario(tmp: Path, scenario: str) -> Ran:
    script = _PRELUDE + textwrap.dedent(SCENARIOS[scenario]) + "\nprint('end of script', flush=True)\n"
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": SRC},
                              capture_output=True, text=True, timeout=EXIT_BOUND_SECS, cwd=tmp)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, time.monotonic() - t0, out
    return proc, time.monotonic() - t0, proc.stdout


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every scenario's subprocess, three at once (each mostly waits on its hung store and its
    bounds), not one after another; each scenario has its own test below."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        runs = pool.map(lambda sc: _run_scenario(tmp_path_factory.mktemp(sc), sc), SCENARIOS)
        return dict(zip(SCENARIOS, runs, strict=True))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_stuck_store_call_never_keeps_the_process_alive(scenario_runs: dict[str, Ran],
                                                          scenario: str) -> None:
    proc, elapsed, out = scenario_runs[scenario]
    if proc is None:
        pytest.fail(f"the process did not exit within {EXIT_BOUND_SECS}s after its script ended: {out!r}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "end of script"
    assert len(lines) == len(EXPECTED[scenario]) + 1, lines
    for want, got in zip(EXPECTED[scenario], lines, strict=False):
        assert got.startswith(want), (want, lines)
    closes = [float(line.split()[-1]) for line in lines if line.startswith("closed in ")]
    assert all(c < 20 for c in closes), f"close() waited past its bound: {closes}"
    assert elapsed < EXIT_BOUND_SECS


def test_daemon_pool_runs_work_and_bounds_shutdown() -> None:
    pool = DaemonThreadPool(2, "kvbucket-test")
    assert [f.result(timeout=5) for f in [pool.submit(pow, 2, i) for i in range(5)]] == [1, 2, 4, 8, 16]
    assert list(pool.map(str, [1, 2])) == ["1", "2"]
    assert all(t.daemon and t.name.startswith("kvbucket-test_") for t in pool.threads)
    assert len(pool.threads) <= 2
    pool.shutdown()
    pool = DaemonThreadPool(1, "kvbucket-test")
    release = threading.Event()
    stuck = pool.submit(release.wait)
    while not stuck.running():
        time.sleep(0.01)
    queued = [pool.submit(release.wait) for _ in range(3)]
    t0 = time.monotonic()
    pool.shutdown(wait=True, cancel_futures=True, timeout=0.5)
    assert time.monotonic() - t0 < 5, "shutdown waited past its bound"
    assert all(f.cancelled() for f in queued), "queued work is cancelled"
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    release.set()
    assert stuck.result(timeout=5) is True
    with pytest.raises(ValueError):
        DaemonThreadPool(0)


def test_work_cancelled_by_shutdown_wakes_its_waiters_at_once() -> None:
    """concurrent.futures.wait() counts a future cancelled but not notified as pending: a Hub load
    whose queued work a close() cancelled waited out its whole load_timeout_secs (5-30 s)."""
    from concurrent.futures import wait

    pool = DaemonThreadPool(1, "kvbucket-test")
    release = threading.Event()
    stuck = pool.submit(release.wait)
    queued = [pool.submit(release.wait) for _ in range(3)]
    waiter = threading.Thread(target=lambda: pool.shutdown(wait=False, cancel_futures=True))
    t0 = time.monotonic()
    waiter.start()
    done, pending = wait(queued, timeout=10)
    took = time.monotonic() - t0
    waiter.join(5)
    release.set()
    assert stuck.result(timeout=5) is True
    assert not pending and all(f.cancelled() for f in done), (done, pending)
    assert took < 2.0, f"wait() on cancelled work returned after {took:.2f}s"


def test_put_queue_close_drops_what_cannot_land_in_time() -> None:
    release = threading.Event()
    applied: list[str] = []

    def apply(key: str, view: memoryview) -> None:
        release.wait()
        applied.append(key)

    q = PutQueue("test", apply, maxsize=2)
    for k in ("a", "b", "c"):  # "a" is applied (stuck), "b" and "c" fill the queue
        q.submit(k, memoryview(b"x"))
    t0 = time.monotonic()
    q.close(drain_timeout_secs=0.5)
    assert time.monotonic() - t0 < 5
    assert q.dropped == 3 and q.pending("b") is None
    release.set()
    time.sleep(0.2)
    assert "b" not in applied and "c" not in applied, "a dropped put must not land after close()"


def test_a_pool_dropped_without_shutdown_ends_its_workers() -> None:
    import gc

    pool = DaemonThreadPool(2, "kvbucket-dropped")
    assert pool.submit(int, "7").result(timeout=5) == 7
    threads = pool.threads
    del pool
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_exit_lets_a_running_pool_call_end_within_the_drain_bound(tmp_path: Path) -> None:
    """A call still running on a pool nobody closed (a read-ahead landing) ends before the
    interpreter finalizes, instead of being cut off inside it (an abort in C++ frames); one that
    outlasts EXIT_DRAIN_SECS is still abandoned, so exit stays bounded."""
    marker, stuck = tmp_path / "landed", tmp_path / "stuck"
    script = textwrap.dedent(f"""
        import time
        from kvbucket.threads import DaemonThreadPool
        pool = DaemonThreadPool(2)
        def land(path, secs):
            time.sleep(secs)
            open(path, "w").close()
        pool.submit(land, {str(marker)!r}, 0.5)
        pool.submit(land, {str(stuck)!r}, 60)
        time.sleep(0.1)
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()  # the drain waited for the 0.5 s call
    assert not stuck.exists() and time.monotonic() - started < 20  # the 60 s one was abandoned


def test_prestarted_workers_take_a_batch_without_starting_any() -> None:
    """prestart() starts idle workers up to the bound; a batch as wide as the pool then runs all
    at once on them (the barrier needs every call in flight together) and no thread is added."""
    pool = DaemonThreadPool(6, "kvbucket-test-prestart")
    try:
        assert pool.prestart(4) == 4
        assert pool.prestart() == 2 and pool.prestart(10) == 0  # capped at max_workers
        threads = pool.threads
        barrier = threading.Barrier(6, timeout=10)
        futs = [pool.submit(barrier.wait) for _ in range(6)]
        assert sorted(f.result(timeout=10) for f in futs) == list(range(6))
        assert pool.threads == threads
    finally:
        pool.shutdown()
    assert pool.prestart() == 0  # a pool shut down starts nothing


_POOL_FORK = r"""
import os, sys, time
from kvbucket.threads import DaemonThreadPool, ForkSafeSemaphore
pool = DaemonThreadPool(2)
pool.prestart()  # idle workers, counted idle: a submit starts none
assert pool.submit(lambda: 1).result(5) == 1
sem = ForkSafeSemaphore(2)
assert sem.acquire(timeout=0) and sem.acquire(timeout=0)  # held by this process's "threads"
pid = os.fork()
if pid == 0:
    try:
        ok = pool.submit(lambda: 2).result(5) == 2 and sem.free() == 2
    except Exception:
        ok = False
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_pool_work_and_has_every_permit() -> None:
    """A child forked from a process whose pool had idle workers has none of them, yet the pool
    counted them idle and started none: its work waited forever (a Hub load in the child timed
    out on every item). A fork-safe semaphore held in the parent is whole in the child."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _POOL_FORK], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
