"""One-shot commands open a Hub bucket store without its prestarted threads.

``HFBucketStore`` starts its 64 load and 64 request threads when it opens, for a serving
engine's first batch; a command such as ``kvbucket ls`` or ``get`` would pay for them on every
run (20-70 ms per open on this machine) and use a few at most. The CLI opens stores through
``open_for_command``, which asks for ``prestart=False``; the library's ``open_store`` keeps the
prestart. Threads are counted by name, in this process.
"""

from __future__ import annotations

import os
import threading

import pytest
from cli_run import run_cli

from kvbucket.cli.common import open_for_command, opened_store
from kvbucket.stores import open_store
from kvbucket.stores.hub import client as hub_client
from kvbucket.testing.hub_fixtures import HubBucket

PREFIXES = ("kvbucket-hfbucket-load", hub_client._REQUEST_THREAD_NAME)


def new_threads(before: set[threading.Thread]) -> dict[str, int]:
    """Live threads started since ``before`` (the threads alive then), counted by pool name. The
    thread objects, not their idents: an ident of a thread that ended is reused by the next one
    (CI once counted 15 of 16 new load threads that way)."""
    new = [t.name for t in threading.enumerate() if t not in before]
    return {p: sum(n.startswith(p) for n in new) for p in PREFIXES}


@pytest.fixture
def hub_env(hub_bucket: HubBucket, monkeypatch: pytest.MonkeyPatch) -> str:
    """The emulator as a user's environment names it; returns the bucket's URL."""
    monkeypatch.setenv("HF_ENDPOINT", hub_bucket.hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub_bucket.hub.write_token)
    return f"hf://buckets/{hub_bucket.bucket_id}/cli"


def test_a_command_opens_a_hub_store_without_starting_threads(hub_env: str) -> None:
    before = set(threading.enumerate())
    for create in (False, None):  # inspection (ls, du, rm, verify, migrate, doctor), compile-cache
        store = open_for_command(hub_env, create=create)
        try:
            assert new_threads(before) == {p: 0 for p in PREFIXES}
        finally:
            store.close()
    with opened_store(hub_env) as store:  # opened, then probed with one listing
        data = [os.urandom(4096) for _ in range(3)]
        assert all(r.ok for r in store.put_many([(f"k{i}", d) for i, d in enumerate(data)]))
        got = store.get_many([f"k{i}" for i in range(3)])
        assert [bytes(memoryview(r.data)) for r in got] == data  # type: ignore[arg-type]
        started = new_threads(before)  # as the calls needed them, not 64 of each
        assert started["kvbucket-hfbucket-load"] <= 3 and started[hub_client._REQUEST_THREAD_NAME] <= 8


def test_the_library_still_prestarts(hub_env: str) -> None:
    before = set(threading.enumerate())
    store = open_store(hub_env, load_concurrency=16)
    try:
        assert new_threads(before) == {"kvbucket-hfbucket-load": 16,
                                       hub_client._REQUEST_THREAD_NAME: hub_client._REQUEST_THREADS}
    finally:
        store.close()


def test_ls_du_and_rm_on_a_hub_bucket_as_a_user_runs_them(hub_bucket: HubBucket,
                                                        cli_env: dict[str, str]) -> None:
    """The commands on a store opened without prestarted threads, run as a user would."""
    env = {**cli_env, "HF_ENDPOINT": hub_bucket.hub.endpoint, "HF_TOKEN": hub_bucket.hub.write_token}
    url = f"hf://buckets/{hub_bucket.bucket_id}/cli"
    store = open_store(url, endpoint=hub_bucket.hub.endpoint, token=hub_bucket.hub.write_token, token_env="")
    try:
        assert all(r.ok for r in store.put_many([("a", os.urandom(5000)), ("b", os.urandom(3000))]))
    finally:
        store.close()
    r = run_cli("ls", url, env=env)
    assert r.code == 0, r.err
    assert sorted(ln.split()[-1] for ln in r.out.splitlines()) == ["a", "b"]
    r = run_cli("du", url, env=env)
    assert r.code == 0 and r.out.startswith("2 objects, 8000 bytes"), (r.out, r.err)
    r = run_cli("rm", url, "a", env=env)
    assert r.code == 0, r.err
    r = run_cli("ls", url, env=env)
    assert r.code == 0 and [ln.split()[-1] for ln in r.out.splitlines()] == ["b"], (r.out, r.err)
