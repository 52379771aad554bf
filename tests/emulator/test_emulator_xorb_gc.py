"""Xorb collection (issue 40 item 8): unreferenced xorbs go after a grace period, live files stay whole.

Driven by the real huggingface_hub/hf_xet. Random contents, one upload per file: each file gets
a xorb of its own (hf_xet packs one upload's files together), so "what live files need" is
one xorb per live file and random bytes store as they are.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from kvbucket.testing import HubEmulator
from kvbucket.testing.hub_emulator.state import State
from kvbucket.testing.hub_emulator.xet import XorbIndex
from kvbucket.testing.hub_emulator.xorb_gc import XorbCollector

KiB = 1024


def _xorbs(data_dir: Path) -> dict[str, int]:
    """Stored xorb files (not upload temp files): name -> bytes."""
    return {p.name: p.stat().st_size for p in (data_dir / "xorbs").rglob("*")
            if p.is_file() and not p.name.startswith(".")}  # fmt: skip


def _read_all(api: HfApi, bucket: str, want: dict[str, bytes], out: Path) -> None:
    api.download_bucket_files(bucket, [(p, out / p) for p in want])
    for p, data in want.items():
        assert (out / p).read_bytes() == data, p


def test_churn_then_collect_with_grace_0_keeps_exactly_what_live_files_need(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "data") as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/churn")
        live: dict[str, bytes] = {}
        for i in range(6):
            live[f"f{i}"] = os.urandom(300 * KiB + i * 50 * KiB)
            api.batch_bucket_files("local/churn", add=[(live[f"f{i}"], f"f{i}")])
        for p in ("f0", "f1"):  # overwritten
            live[p] = os.urandom(200 * KiB)
            api.batch_bucket_files("local/churn", add=[(live[p], p)])
        api.batch_bucket_files("local/churn", delete=["f2", "f3"])
        del live["f2"], live["f3"]
        before = _xorbs(emu.data_dir)
        assert len(before) == 8

        kept = emu.collect_xorbs()  # the default grace (22 days) keeps every unreferenced xorb
        assert (kept["xorbs"], kept["unreferenced_kept"]) == (0, 4)
        assert _xorbs(emu.data_dir) == before

        done = emu.collect_xorbs(grace_s=0)
        after = _xorbs(emu.data_dir)
        assert done["xorbs"] == 4 and done["bytes"] > 0 and done["unreferenced_kept"] == 0
        assert len(after) == len(live) == 4 and set(after) < set(before)
        need = sum(len(d) for d in live.values())
        assert need <= sum(after.values()) <= need * 1.01 + 4 * 64 * KiB  # chunk headers, footer
        _read_all(api, "local/churn", live, tmp_path / "out1")
        assert emu.collect_xorbs(grace_s=0)["xorbs"] == 0  # nothing more to take
        emu.restart()  # the index agrees with the disk after a restart
        _read_all(api, "local/churn", live, tmp_path / "out2")


_UPLOAD = """
import sys
from huggingface_hub import HfApi
endpoint, bucket, src, dest = sys.argv[1:5]
HfApi(endpoint=endpoint, token=False).batch_bucket_files(bucket, add=[(src, dest)])
"""


def test_a_collected_xorb_is_uploaded_again_by_a_new_client(tmp_path: Path) -> None:
    """The same content after its xorb was dropped: a client with a fresh HF_XET_CACHE uploads the
    xorb again, and the file reads right. The client that uploaded it first still has it in its
    shard cache, dedups against it and gets the 400 the real CAS gives for a shard naming a
    missing xorb (xet-core spec/upload_protocol.md): why the default grace outlives that cache."""
    content = os.urandom(700 * KiB)
    src = tmp_path / "content.bin"
    src.write_bytes(content)
    with HubEmulator(tmp_path / "data") as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/again")
        api.batch_bucket_files("local/again", add=[(content, "a")])
        first = _xorbs(emu.data_dir)
        api.batch_bucket_files("local/again", delete=["a"])
        assert emu.collect_xorbs(grace_s=0)["xorbs"] == 1
        assert _xorbs(emu.data_dir) == {}

        home = tmp_path / "fresh-client"
        env = {**os.environ, "HF_HOME": str(home), "HF_XET_CACHE": str(home / "xet")}
        subprocess.run([sys.executable, "-c", _UPLOAD, emu.endpoint, "local/again", str(src), "b"],
                       env=env, check=True, capture_output=True, timeout=300)  # fmt: skip
        assert _xorbs(emu.data_dir) == first  # the same content-addressed xorb, stored again
        _read_all(api, "local/again", {"b": content}, tmp_path / "out")

        api.batch_bucket_files("local/again", delete=["b"])
        assert emu.collect_xorbs(grace_s=0)["xorbs"] == 1
        with pytest.raises(Exception, match="400"):  # this process's shard cache names the xorb
            api.batch_bucket_files("local/again", add=[(content, "c")])
        assert list(api.get_bucket_paths_info("local/again", ["c"])) == []  # refused, never half-added


def test_the_grace_period_keeps_recently_unreferenced_xorbs(tmp_path: Path) -> None:
    with HubEmulator(tmp_path / "data", xorb_grace_s=2.0) as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/grace")
        api.batch_bucket_files("local/grace", add=[(os.urandom(100 * KiB), "a")])
        newest = os.urandom(100 * KiB)
        api.batch_bucket_files("local/grace", add=[(newest, "a")])  # the first version: unreferenced
        assert emu.collect_xorbs() == {"xorbs": 0, "bytes": 0, "reconstructions": 0,
                                       "unreferenced_kept": 1, "grace_s": 2.0}  # fmt: skip
        # old files (an existing data dir): still kept until seen unreferenced for the grace
        hour_ago = time.time() - 3600
        for name in _xorbs(emu.data_dir):
            os.utime(emu.data_dir / "xorbs" / name[:2] / name, (hour_ago, hour_ago))
        assert emu.collect_xorbs()["unreferenced_kept"] == 1
        time.sleep(2.2)
        done = emu.collect_xorbs()
        assert (done["xorbs"], done["reconstructions"], done["unreferenced_kept"]) == (1, 1, 0)
        assert len(_xorbs(emu.data_dir)) == 1
        _read_all(api, "local/grace", {"a": newest}, tmp_path / "out")


def test_collection_concurrent_with_uploads_and_reads_breaks_neither(tmp_path: Path) -> None:
    """Writers overwrite their files while a collector runs with a 3 s grace (longer than a
    shard-to-addFile gap) and readers read: every upload and read succeeds, old versions go."""
    with HubEmulator(tmp_path / "data", xorb_grace_s=3.0) as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/busy")
        stable = {f"s{i}": os.urandom(150 * KiB) for i in range(3)}
        for p, d in stable.items():
            api.batch_bucket_files("local/busy", add=[(d, p)])
        latest: dict[str, bytes] = {}
        errors: list[BaseException] = []
        collected: list[int] = []
        stop = time.monotonic() + 12.0

        def writer(k: int) -> None:
            while time.monotonic() < stop and not errors:
                data = os.urandom(100 * KiB + k * 7 * KiB)
                api.batch_bucket_files("local/busy", add=[(data, f"w{k}")])
                latest[f"w{k}"] = data

        def reader(k: int) -> None:
            n = 0
            while time.monotonic() < stop and not errors:
                _read_all(api, "local/busy", stable, tmp_path / f"r{k}-{n % 2}")
                n += 1

        def collector() -> None:
            while time.monotonic() < stop and not errors:
                collected.append(emu.collect_xorbs()["xorbs"])
                time.sleep(0.2)

        def guarded(fn: object, *args: int) -> threading.Thread:
            def run() -> None:
                try:
                    fn(*args)  # type: ignore[operator]
                except BaseException as e:
                    errors.append(e)
            t = threading.Thread(target=run)
            t.start()
            return t

        threads = [guarded(writer, 0), guarded(writer, 1), guarded(reader, 0), guarded(collector)]
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert sum(collected) > 0  # old versions were collected while uploads ran
        emu.collect_xorbs(grace_s=0)
        assert len(_xorbs(emu.data_dir)) == len(stable) + len(latest)
        _read_all(api, "local/busy", {**stable, **latest}, tmp_path / "final")


def test_a_collection_waits_for_an_upload_using_the_xorb(tmp_path: Path) -> None:
    """The race: a shard being accepted (the guard held shared) while its xorb would be dropped.
    The collection batch waits; a use it waited for (the mtime touched) keeps the xorb."""
    state = State(tmp_path / "data")
    try:
        xorb = "ab" * 32
        state.put_xorb(XorbIndex(xorb, [0, 10], [10], [b"h" * 32]), b"0123456789")
        gc = XorbCollector(state, grace_s=0)
        results: list[int] = []
        with state.xorb_guard.shared():
            t = threading.Thread(target=lambda: results.append(gc.collect().xorbs))
            t.start()
            t.join(timeout=0.5)
            assert t.is_alive() and state.has_xorb(xorb)  # blocked behind the upload
            time.sleep(0.01)
            assert state.touch_xorb(xorb)  # the upload uses the xorb
        t.join(timeout=10)
        assert results == [0] and state.has_xorb(xorb)
        assert gc.collect().xorbs == 1 and not state.has_xorb(xorb)
        assert not state.xorb_path(xorb).exists()
    finally:
        state.close()


def test_collection_runs_in_the_background(tmp_path: Path) -> None:
    """No admin call: the server's own periodic pass (every 5 s at the shortest) drops the xorb."""
    with HubEmulator(tmp_path / "data", xorb_grace_s=0.5) as emu:
        api = HfApi(endpoint=emu.endpoint, token=False)
        api.create_bucket("local/bg")
        keep = os.urandom(80 * KiB)
        api.batch_bucket_files("local/bg", add=[(os.urandom(80 * KiB), "gone"), (keep, "kept")])
        api.batch_bucket_files("local/bg", add=[(keep, "kept2")])  # deduped: no xorb of its own
        api.batch_bucket_files("local/bg", delete=["gone"])  # its xorb holds "kept": stays
        api.batch_bucket_files("local/bg", add=[(os.urandom(80 * KiB), "later")])
        api.batch_bucket_files("local/bg", delete=["later"])
        assert len(_xorbs(emu.data_dir)) == 2
        deadline = time.monotonic() + 30
        while len(_xorbs(emu.data_dir)) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_xorbs(emu.data_dir)) == 1
        _read_all(api, "local/bg", {"kept": keep, "kept2": keep}, tmp_path / "out")
