"""A delete names the version it judged; damage on the wire is read again (issue 39).

Over a directory, SeaweedFS and a Hub bucket (the emulator driven by huggingface_hub/hf_xet):

- the no-hook race (a writer storing v2 at a random 0-4 ms moment while a reader refuses a
  damaged v1) loses no valid rewrite (20 trials per kind here; on the Hub, once the writer's
  re-check ran; benchmarks/delete_races.py runs 300 per kind);
- a forced interleaving (a hook between the judgement and the delete, storing a new version)
  of every delete kvbucket makes on its own: the refusal, capacity eviction, ``verify
  --delete-bad`` and ``rm --identity``: the new version survives, every time;
- a bit flipped in transit (a proxy, the emulator's fault rule) leaves the object in place and
  the load serves the right bytes from the re-read; damage in storage is still removed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvbucket import envelope as env
from kvbucket.stores.base import ObjectStore
from kvbucket.stores.guard.refusals import DELETES_KEPT, INTEGRITY_REREADS
from kvbucket.stores.guard.sealed import seal_store
from kvbucket.stores.hub.config import HFBucketConfig
from kvbucket.stores.hub.store import HFBucketStore
from kvbucket.stores.s3.config import S3Config
from kvbucket.stores.s3.store import S3Store
from kvbucket.testing.delete_races import HookedStore, damage, refusal_race, sealed_pair


def count(counter: Any, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


# The Hub's bucket API deletes without a condition, so a write committed between the paths-info
# that compares the Xet hash and the deleteFile batch is removed; its writer's re-check adds it back
# (stores/hub/rechecks.py): ``lost`` counts what stays lost after it (benchmarks/delete_races.py
# runs 300 trials; tests/integrity/test_integrity_hub_rechecks.py forces the interleaving).
def test_no_hook_refusal_race_loses_no_rewrite(open_store: Callable[[], ObjectStore]) -> None:
    report = refusal_race(open_store, 20, seed=7)
    assert report.trials == 20 and report.lost == 0, report.lost_names


def test_refusal_keeps_a_version_written_between_judgement_and_delete(
    open_store: Callable[[], ObjectStore],
) -> None:
    v1, v2 = os.urandom(3000), os.urandom(3000)
    writer = seal_store(open_store(), tier="w", identity="race")
    reader, hooked, _ = sealed_pair(open_store, lambda names: writer.put(names[0], v2))
    writer.put("n", v1)
    damage(writer.inner, "n")
    kept = count(DELETES_KEPT, "refusal")
    assert reader.get("n") is None  # v1 judged damaged (twice): a miss
    assert hooked.hooked == ["n"]  # the writer stored v2 right before the delete
    assert seal_store(open_store(), tier="c", identity="race").get("n") == v2
    assert count(DELETES_KEPT, "refusal") == kept + 1


def test_damage_in_storage_is_still_removed(open_store: Callable[[], ObjectStore]) -> None:
    writer = seal_store(open_store(), tier="w", identity="race")
    reader = seal_store(open_store(), tier="damage-at-rest", identity="race")
    writer.put("n", os.urandom(3000))
    damage(writer.inner, "n")
    before = count(INTEGRITY_REREADS, "damage-at-rest", "damaged")
    assert reader.get("n") is None
    assert writer.inner.head("n") is None  # seen twice: damage in storage, removed
    assert count(INTEGRITY_REREADS, "damage-at-rest", "damaged") == before + 1


class Rewriter:
    """Another adapter on the same place: the hook that stores the first of the names it is
    handed again (a new version), and loads it back afterwards."""

    def __init__(self, store: ObjectStore, keys: list[Any], chunk: int, value: int) -> None:
        from kvbucket.l2 import ObjectStoreL2Adapter

        self.adapter = ObjectStoreL2Adapter(store, full_chunk_bytes=chunk)
        self.keys, self.chunk, self.value = keys, chunk, bytes([value]) * chunk
        self.rewritten: list[Any] = []

    def __call__(self, names: list[str]) -> None:
        from kvbucket.testing import l2 as t

        key = next(k for k in self.keys if self.adapter._naming.write_name(k) == names[0])
        assert t.store(self.adapter, [key], [self.value]).success
        self.rewritten.append(key)

    def survived(self) -> bool:
        from kvbucket.testing import l2 as t

        out = bytearray(self.chunk)
        return t.load(self.adapter, self.rewritten[:1], [out]) == [True] and bytes(out) == self.value


def test_eviction_keeps_a_version_written_since_the_index_saw_it(
    open_store: Callable[[], ObjectStore],
) -> None:
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import EvictionConfig, ObjectStoreL2Adapter
    from kvbucket.testing import l2 as t

    chunk = 512
    keys = [ObjectKey("m", 1, i.to_bytes(4, "big")) for i in range(6)]
    other = Rewriter(open_store(), keys, chunk, 7)
    hooked = HookedStore(open_store(), other)
    # 6 chunks stored, 4 over the watermark (0.8 * 5): the 2 oldest go (target 0.6 * 5 = 3 chunks);
    # the rewritten one is kept, recent, and room is made by evicting the next oldest instead.
    cfg = EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(hooked, max_capacity_bytes=5 * chunk, eviction=cfg, full_chunk_bytes=chunk)
    try:
        for i, k in enumerate(keys):
            assert t.store(a, [k], [bytes([i + 1]) * chunk]).success
        for _ in range(300):
            if other.rewritten and not a._evicting:
                break
            time.sleep(0.02)
        assert other.rewritten, "no eviction ran"
        assert other.survived()
    finally:
        a.close()
        other.adapter.close()


def test_fleet_eviction_keeps_a_version_written_since_its_victims_were_chosen(
    open_store: Callable[[], ObjectStore],
) -> None:
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import EvictionConfig, ObjectStoreL2Adapter
    from kvbucket.testing import l2 as t

    chunk = 512
    keys = [ObjectKey("m", 1, i.to_bytes(4, "big")) for i in range(6)]
    other = Rewriter(open_store(), keys, chunk, 5)
    hooked = HookedStore(open_store(), other, only=lambda n: not n.startswith("_fleet/"))
    fleet = FleetConfig(node_id="a", sync_secs=0.1, heartbeat_secs=0.5, node_timeout_secs=5.0,
                        compact_secs=0.5, grace_secs=0.0)
    cfg = EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
    a = ObjectStoreL2Adapter(hooked, max_capacity_bytes=5 * chunk, eviction=cfg, full_chunk_bytes=chunk,
                             fleet=fleet)
    try:
        assert a.wait_until_rebuilt(30)
        kept = count(DELETES_KEPT, "fleet_eviction")
        for i, k in enumerate(keys):
            assert t.store(a, [k], [bytes([i + 1]) * chunk]).success
        deadline = time.monotonic() + 30
        while not other.rewritten or count(DELETES_KEPT, "fleet_eviction") == kept:
            assert time.monotonic() < deadline, "no fleet eviction met the rewrite"
            time.sleep(0.05)
        assert other.survived()
    finally:
        a.close()
        other.adapter.close()


def test_verify_delete_bad_keeps_a_version_written_since_the_scan(
    open_store: Callable[[], ObjectStore],
) -> None:
    from kvbucket.cli.verify_cmd import remove_damaged

    v2 = os.urandom(2000)
    writer = seal_store(open_store(), tier="w")
    writer.put("bad", os.urandom(2000))
    writer.put("also-bad", os.urandom(2000))
    damage(writer.inner, "bad")
    damage(writer.inner, "also-bad")
    hooked = HookedStore(open_store(), lambda names: writer.put("bad", v2))
    removed, kept = remove_damaged(hooked, ["bad", "also-bad"], None, {})
    assert (removed, kept) == (1, 1)
    assert writer.get("bad") == v2 and writer.inner.head("also-bad") is None


def test_rm_identity_keeps_a_chunk_written_since_the_listing(
    open_store: Callable[[], ObjectStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from kvbucket.cli import build_app, store_cmd
    from kvbucket.identity.core import IdentitySetting
    from kvbucket.keys import ObjectKey
    from kvbucket.l2 import ObjectStoreL2Adapter
    from kvbucket.l2.naming import Naming
    from kvbucket.testing import l2 as t

    chunk, model, ident = 256, "org/llama", "org/llama@rev-1"
    keys = [ObjectKey(model, 0, i.to_bytes(8, "big")) for i in range(3)]
    rewritten: list[ObjectKey] = []
    writer = ObjectStoreL2Adapter(open_store(), full_chunk_bytes=chunk,
                                  naming=Naming(identity=IdentitySetting(ident)))
    try:
        assert t.store(writer, keys, [bytes([i + 1]) * chunk for i in range(3)]).success

        def rewrite(names: list[str]) -> None:  # the first chunk of the batch (not the manifest)
            key = next(k for n in names for k in keys if writer._naming.write_name(k) == n)
            assert t.store(writer, [key], [b"\x09" * chunk]).success
            rewritten.append(key)

        @contextmanager
        def hooked_store(url: str, timeout: float = 30.0) -> Iterator[ObjectStore]:
            with open_store() as s:  # the command's store, with the hook before its first delete
                yield HookedStore(s, rewrite)

        monkeypatch.setattr(store_cmd, "opened_store", hooked_store)
        url = open_store().url
        token = IdentitySetting(ident).token(model) or ""
        r = CliRunner().invoke(build_app(), ["rm", url, "--model", model, "--identity", token, "--json"])
        assert r.exit_code == 0, r.output
        out = bytearray(chunk)
        assert t.load(writer, [rewritten[0]], [out]) == [True]
        assert bytes(out) == b"\x09" * chunk
        others = [writer._naming.write_name(k) for k in keys if k != rewritten[0]]
        assert [r.size for r in open_store().head_many(others)] == [None, None]  # those were removed
    finally:
        writer.close()


# ---- damage on the wire ----------------------------------------------------------------------
def test_a_bit_flipped_by_a_proxy_is_read_again_and_served(seaweedfs: Any, s3_bucket: str, fault_proxy: Any
                                                           ) -> None:
    from kvbucket.testing.fault_proxy import FLIP

    cfg = S3Config.parse(seaweedfs.config(s3_bucket, s3_endpoint_url=fault_proxy.url))
    data = os.urandom(64 << 10)
    with seal_store(S3Store(cfg), tier="s3-wire") as s:
        s.put("n", data)
        for into in (None, bytearray(len(data))):
            fault_proxy.fail(FLIP, times=1, methods={"GET"})
            intact = count(INTEGRITY_REREADS, "s3-wire", "intact")
            if into is None:
                assert s.get("n") == data
            else:
                assert s.get_into("n", into) and bytes(into) == data
            assert fault_proxy.injected >= 1 and count(INTEGRITY_REREADS, "s3-wire", "intact") == intact + 1
            assert s.inner.head("n") == len(data) + env.HEADER_SIZE  # still in the bucket


def test_a_bit_flipped_in_a_xet_fetch_is_read_again_and_served(hub_bucket: Any) -> None:
    cfg = HFBucketConfig(bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/kv",
                         token=hub_bucket.hub.write_token, endpoint=hub_bucket.hub.endpoint)
    data = os.urandom(256 << 10)  # random: stored uncompressed, so the flip lands in the payload
    with seal_store(HFBucketStore(cfg), tier="hub-wire") as s:
        s.put("n", data)
        hub_bucket.hub.faults.add("fetch", flip=True, times=1)
        out = bytearray(len(data))
        assert s.get_into("n", out) and bytes(out) == data
        assert count(INTEGRITY_REREADS, "hub-wire", "intact") == 1
        assert s.inner.head("n") == len(data) + env.HEADER_SIZE
        assert hub_bucket.hub.faults.rules()[0]["fired"] == 1


def test_an_engine_tiers_fleet_eviction_keeps_a_version_written_since(
    open_store: Callable[[], ObjectStore],
) -> None:
    """The fleet member of a tier without an index (the engine tiers, the non-MP connector:
    kvbucket.fleet.member.StoreFleet) deletes its victims by the version a HEAD sees: a writer's
    new version between that HEAD and the delete is kept."""
    from kvbucket.backends.remote import RemoteBackend
    from kvbucket.chunks import KVLayout
    from kvbucket.fleet.config import FleetConfig
    from kvbucket.integrations.engine_fleet import FleetSettings
    from kvbucket.keys import CacheEngineKey, key_to_name
    from kvbucket.l2.eviction import EvictionConfig

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="bfloat16", chunk_tokens=4)
    chunk = layout.full_chunk_bytes
    keys = [CacheEngineKey("org/model", 1, 0, 500 + i, "bfloat16") for i in range(8)]
    names = {key_to_name(k.to_string()): k for k in keys}
    other = RemoteBackend(open_store(), layout)
    rewritten: list[CacheEngineKey] = []

    def rewrite(victims: list[str]) -> None:
        key = names[victims[0]]
        assert other.batched_put([(key, b"\x0b" * chunk)]) == 1
        rewritten.append(key)

    hooked = HookedStore(open_store(), rewrite, only=lambda n: n in names)
    settings = FleetSettings(
        fleet=FleetConfig(node_id="a", sync_secs=0.1, heartbeat_secs=0.5, node_timeout_secs=5.0,
                          compact_secs=0.5, grace_secs=0.0),
        max_capacity_gb=5 * chunk / 1024**3,
        eviction=EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2))
    kept = count(DELETES_KEPT, "fleet_eviction")
    with RemoteBackend(hooked, layout, fleet=settings) as tier:
        for i, k in enumerate(keys[:6]):
            tier.batched_put([(k, bytes([i + 1]) * chunk)])
        deadline = time.monotonic() + 30
        while not rewritten or count(DELETES_KEPT, "fleet_eviction") == kept:
            assert time.monotonic() < deadline, "no fleet eviction met the rewrite"
            time.sleep(0.05)
    got = other.get(rewritten[0])
    assert got is not None and bytes(memoryview(got).cast("B")) == b"\x0b" * chunk
    other.close()


def test_an_eviction_whose_head_finds_nothing_deletes_nothing_by_name(
    open_store: Callable[[], ObjectStore],
) -> None:
    """Eviction without a known version asks a HEAD: a name it finds gone is reported gone, not
    removed by name (which would take a writer's version stored right after that HEAD)."""
    from kvbucket.stores.guard.refusals import delete_as_seen

    writer, raw = open_store(), open_store()

    class HeadThenWrite(HookedStore):
        def head_many(self, names: Any) -> Any:
            out = self.inner.head_many(names)
            writer.put("n", b"v2")  # stored after the HEAD saw nothing
            return out

    store = HeadThenWrite(raw, lambda names: None)
    (r,) = delete_as_seen(store, ["n"], {}, "eviction").values()
    assert r.ok and not getattr(r, "removed", True)
    assert writer.get("n") == b"v2"
    writer.close()
    raw.close()
