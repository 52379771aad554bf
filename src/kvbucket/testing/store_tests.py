"""``StoreTests``: the conformance suite every :class:`~kvbucket.stores.ObjectStore` must pass.

Modelled on zarr-python's ``zarr.testing.store.StoreTests``: subclass it in a test module,
provide a ``store`` fixture that yields a fresh, empty store, declare the store's capabilities,
and pytest collects every test below against your store::

    import pytest
    from kvbucket.stores.local.file import FileStore
    from kvbucket.testing.store_tests import StoreTests

    class TestMyFileStore(StoreTests):
        supports_reopen = True
        lists_sorted = True

        @pytest.fixture
        def store(self, tmp_path):
            with FileStore(tmp_path / "s") as s:
                yield s

        def reopen(self, store):
            return FileStore(store.root)

Capabilities are explicit class attributes, so a store that lacks one shows up as a *reported*
skip with the reason, never as a test that silently passes:

- ``supports_reopen`` (required, bool): a second store opened on the same location sees the
  first one's data. When True, implement :meth:`StoreTests.reopen`.
- ``lists_sorted`` (bool, default False): ``list()`` yields names in lexicographic order.
- ``name_and_prefix_coexist`` (bool, default True): an object ``a`` and objects under ``a/``
  can exist together (object stores: yes; a directory tree: no, and the second put must then
  fail for that item only, leaving the first object intact).
- ``deletes_conditionally`` (bool, default True): ``delete_versions`` has no window (a condition
  the server checks, or a local compare that cannot be raced); False (a Hub bucket) lets the
  damage run report good chunks lost in the window instead of failing on them.
- ``checks_served_bytes`` (bool, default False): a persistent store the KV tiers load from; the
  served-bytes invariant is checked on it at random moments (:mod:`kvbucket.testing.served_bytes`:
  sealed and encrypted, read-ahead on and off; ``KVBUCKET_SERVED_ROUNDS`` / ``KVBUCKET_SERVED_SEED``
  / ``KVBUCKET_SERVED_CHUNK_KIB`` set the rounds per cell, the seed and the chunk size).

Sizes are modest (at most 2 MiB per object) so the suite runs quickly against remote servers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pytest

from kvbucket.errors import InvalidKeyError, SizeMismatchError
from kvbucket.stores.base import ObjectInfo, ObjectStore, Scatter
from kvbucket.testing.capabilities import requires
from kvbucket.testing.served_bytes import run_cell, settings_from_env

ROUND_TRIP_SIZES = (0, 1, 65_535, 65_537, 2 * 1024 * 1024)

# Names every store must accept and give back unchanged (list() output feeds get_many()).
AWKWARD_NAMES = (
    "percent%2Fliteral",
    "model@1@0@-4a3f@bfloat16",
    "ünïcödé/日本語/ключ",
    "deeply/nested/a/b/c/d",
    "dots.in.names~and_dashes-1",
)

# Names no store may accept: each would be empty, absolute, or climb out of the store's prefix.
INVALID_NAMES = (
    "",
    "/absolute",
    "trailing/",
    "a//b",
    ".",
    "..",
    "../escape",
    "a/../../escape",
    "a/./b",
    "back\\slash",
    "nul\x00byte",
    "new\nline",
    "x" * 1025,
    "lone\ud800surrogate",  # not valid UTF-8: no store can encode it
    "escaped\udcff",  # what os.fsdecode makes of an undecodable byte
)


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every offset (catches shifted or mixed-up writes)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class StoreTests:
    """Conformance tests for the object-store protocol. Subclasses provide ``store``."""

    supports_reopen: ClassVar[bool]
    lists_sorted: ClassVar[bool] = False
    name_and_prefix_coexist: ClassVar[bool] = True
    checks_served_bytes: ClassVar[bool] = False
    deletes_conditionally: ClassVar[bool] = True

    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        """A fresh, empty store; closed at the end of the test. Subclasses must override this."""
        raise NotImplementedError(f"{type(self).__name__} must define a `store` fixture")

    def reopen(self, store: ObjectStore) -> ObjectStore:
        """A new store on the same location as ``store`` (when ``supports_reopen``)."""
        raise NotImplementedError(f"{type(self).__name__} sets supports_reopen but lacks reopen()")

    # ---- capabilities ---------------------------------------------------------------------
    def test_capabilities_are_declared(self) -> None:
        assert isinstance(getattr(type(self), "supports_reopen", None), bool), (
            f"{type(self).__name__} must declare `supports_reopen = True/False`"
        )
        assert isinstance(self.lists_sorted, bool)

    def test_store_starts_empty(self, store: ObjectStore) -> None:
        assert list(store.list()) == []

    # ---- round trips ----------------------------------------------------------------------
    @pytest.mark.parametrize("size", ROUND_TRIP_SIZES)
    def test_round_trip(self, store: ObjectStore, size: int) -> None:
        data = payload(size, seed=size)
        (r,) = store.put_many([(f"obj-{size}", data)])
        assert r.ok and r.name == f"obj-{size}" and r.size == size
        (g,) = store.get_many([f"obj-{size}"])
        assert g.ok and g.found and g.size == size
        assert bytes(g.data) == data
        assert store.head(f"obj-{size}") == size

    @pytest.mark.parametrize("size", [0, 65_537])
    def test_get_into_buffer(self, store: ObjectStore, size: int) -> None:
        data = payload(size, seed=3)
        store.put("into", data)
        buf = bytearray(size)
        (r,) = store.get_many(["into"], [buf])
        assert r.ok and r.size == size and r.data is buf
        assert bytes(buf) == data

    @pytest.mark.parametrize("size", [90, 300_000])
    def test_scatter_read_fills_parts_in_order(self, store: ObjectStore, size: int) -> None:
        """A Scatter (header buffer + caller buffer + tail) is filled like one flat buffer; a
        wrong total size is a SizeMismatchError and no part is written."""
        data = payload(size, seed=11)
        store.put("scatter", data)
        head, body, tail = bytearray(64), np.empty(size - 80, dtype=np.uint8), bytearray(16)
        (r,) = store.get_many(["scatter"], [Scatter(head, body, tail)])
        assert r.ok and r.size == size
        assert bytes(head) + body.tobytes() + bytes(tail) == data
        short = bytearray(b"\xee" * 64)
        (bad,) = store.get_many(["scatter"], [Scatter(short, bytearray(size - 65))])
        assert isinstance(bad.error, SizeMismatchError) and bytes(short) == b"\xee" * 64

    def test_buffer_protocol_objects(self, store: ObjectStore) -> None:
        """numpy arrays (any dtype) and memoryviews go in and come out as raw bytes."""
        arr = np.arange(1000, dtype=np.float16)
        assert store.put("np", arr) == arr.nbytes
        assert store.put("mv", memoryview(b"abc")) == 3
        assert store.put("ba", bytearray(b"defg")) == 4
        out = np.empty_like(arr)
        assert store.get_into("np", memoryview(out))
        np.testing.assert_array_equal(out, arr)
        assert store.get("mv") == b"abc" and store.get("ba") == b"defg"

    def test_overwrite(self, store: ObjectStore) -> None:
        store.put("over", payload(1000, 1))
        store.put("over", payload(10, 2))
        assert store.get("over") == payload(10, 2)
        assert store.head("over") == 10
        assert [i.name for i in store.list()] == ["over"]

    def test_get_if_changed(self, store: ObjectStore) -> None:
        assert store.get_if_changed("cond/x", None).tag is None  # missing
        store.put("cond/x", payload(100, 1))
        first = store.get_if_changed("cond/x", None)
        assert first.tag and first.data == payload(100, 1)
        again = store.get_if_changed("cond/x", first.tag)
        assert again.tag == first.tag and again.data is None  # unchanged: no body
        store.put("cond/x", payload(120, 2))
        changed = store.get_if_changed("cond/x", first.tag)
        assert changed.tag != first.tag and changed.data == payload(120, 2)
        store.delete("cond/x")
        assert store.get_if_changed("cond/x", changed.tag).tag is None

    @pytest.mark.parametrize("name", AWKWARD_NAMES)
    def test_awkward_names_round_trip(self, store: ObjectStore, name: str) -> None:
        store.put(name, name.encode())
        assert store.get(name) == name.encode()
        listed = [i.name for i in store.list()]
        assert listed == [name]
        assert store.get(listed[0]) == name.encode()

    # ---- batches --------------------------------------------------------------------------
    def test_batch_results_in_input_order(self, store: ObjectStore) -> None:
        names = ["e", "b/x", "d", "a", "c"]
        put = store.put_many([(n, payload(i * 100, i)) for i, n in enumerate(names)])
        assert [r.name for r in put] == names
        assert [r.size for r in put] == [i * 100 for i in range(5)]
        assert all(r.ok for r in put)

        query = ["a", "missing-1", "e", "b/x", "missing-2"]
        heads = store.head_many(query)
        assert [(r.name, r.size) for r in heads] == [
            ("a", 300), ("missing-1", None), ("e", 0), ("b/x", 100), ("missing-2", None)
        ]
        gets = store.get_many(query)
        assert [r.name for r in gets] == query
        assert [None if r.data is None else bytes(r.data) for r in gets] == [
            payload(300, 3), None, b"", payload(100, 1), None
        ]
        assert all(r.ok for r in heads + gets)

        dels = store.delete_many(["d", "missing-3", "c"])
        assert [r.name for r in dels] == ["d", "missing-3", "c"]
        assert all(r.ok for r in dels)
        assert dels[1].size is None
        assert dels[0].size in (None, 200) and dels[2].size in (None, 400)
        assert sorted(i.name for i in store.list()) == ["a", "b/x", "e"]

    def test_empty_batches(self, store: ObjectStore) -> None:
        assert store.put_many([]) == []
        assert store.get_many([]) == []
        assert store.head_many([]) == []
        assert store.delete_many([]) == []

    def test_missing_objects_are_not_errors(self, store: ObjectStore) -> None:
        (g,) = store.get_many(["nope"])
        assert g.ok and not g.found and g.size is None and g.data is None
        assert store.get("nope") is None
        assert store.head("nope") is None
        assert not store.exists("nope")
        assert store.get_into("nope", bytearray(4)) is False

    def test_get_many_into_buffers_checks_sizes_per_item(self, store: ObjectStore) -> None:
        store.put_many([("a", payload(64, 1)), ("b", payload(128, 2)), ("c", payload(32, 3))])
        good_a = bytearray(64)
        small_b = bytearray(b"\xab" * 127)  # one byte short
        large_c = bytearray(b"\xcd" * 33)  # one byte long
        results = store.get_many(["a", "b", "c", "d", "a"], [good_a, small_b, large_c, bytearray(8), None])
        assert [r.name for r in results] == ["a", "b", "c", "d", "a"]
        assert results[0].ok and bytes(good_a) == payload(64, 1)
        for r in results[1:3]:
            assert isinstance(r.error, SizeMismatchError), r
            assert r.size is None and r.data is None
        assert bytes(small_b) == b"\xab" * 127, "a buffer of the wrong size must not be written"
        assert bytes(large_c) == b"\xcd" * 33, "a buffer of the wrong size must not be written"
        assert results[3].ok and not results[3].found
        assert results[4].ok and bytes(results[4].data) == payload(64, 1)

    def test_get_into_raises_size_mismatch(self, store: ObjectStore) -> None:
        store.put("x", b"12345")
        with pytest.raises(SizeMismatchError, match="5 bytes"):
            store.get_into("x", bytearray(4))

    def test_get_many_rejects_wrong_buffer_count(self, store: ObjectStore) -> None:
        with pytest.raises(ValueError, match="buffers"):
            store.get_many(["a", "b"], [bytearray(1)])

    # ---- delete ---------------------------------------------------------------------------
    def test_delete_is_idempotent(self, store: ObjectStore) -> None:
        store.put("gone", b"bye")
        (first,) = store.delete_many(["gone"])
        assert first.ok and first.size in (None, 3)
        (second,) = store.delete_many(["gone"])
        assert second.ok and second.size is None
        store.delete("gone")
        assert store.get("gone") is None and store.head("gone") is None

    # ---- versions: a delete names the version it judged (docs/integrity.md) ---------------
    def test_delete_versions_keeps_a_newer_version(self, store: ObjectStore) -> None:
        store.put("v/n", b"first version")
        (v1,) = store.get_versions(["v/n"])
        assert v1.ok and v1.version and bytes(v1.data) == b"first version"
        store.put("v/n", b"the second version, written since")
        (kept,) = store.delete_versions([("v/n", v1.version)])
        assert kept.ok and kept.changed and not kept.removed
        assert store.get("v/n") == b"the second version, written since"
        (v2,) = store.get_versions(["v/n"])
        assert v2.version and v2.version != v1.version
        (gone,) = store.delete_versions([("v/n", v2.version)])
        assert gone.ok and gone.removed and store.get("v/n") is None
        (again,) = store.delete_versions([("v/n", v2.version)])
        assert again.ok and not again.removed and not again.changed
        (missing,) = store.get_versions(["v/missing"])
        assert missing.ok and missing.size is None

    def test_listed_versions_name_what_is_stored(self, store: ObjectStore) -> None:
        store.put_many([("lv/a", b"a1"), ("lv/b", b"b1")])
        listed = {i.name: i.version for i in store.list("lv/")}
        if any(v is None for v in listed.values()):
            pytest.skip(f"{type(store).__name__} lists no versions")
        store.put("lv/a", b"a2, rewritten after the listing")
        out = store.delete_versions(sorted(listed.items()))
        assert [(r.removed, r.changed) for r in out] == [(False, True), (True, False)]
        assert store.get("lv/a") == b"a2, rewritten after the listing" and store.get("lv/b") is None

    def test_delete_nested_keeps_siblings(self, store: ObjectStore) -> None:
        store.put_many([("d/1", b"1"), ("d/2", b"2"), ("d/sub/3", b"3")])
        store.delete("d/sub/3")
        store.delete("d/1")
        assert [i.name for i in store.list()] == ["d/2"]
        store.put("d/sub/4", b"4")  # a name under a directory that may just have been emptied
        assert store.get("d/sub/4") == b"4"

    def test_name_and_prefix(self, store: ObjectStore) -> None:
        store.put("np", b"object")
        nested, other = store.put_many([("np/child", b"child"), ("np-other", b"other")])
        assert other.ok and store.get("np-other") == b"other", "other items of the batch are unaffected"
        if self.name_and_prefix_coexist:
            assert nested.ok
            assert store.get("np") == b"object" and store.get("np/child") == b"child"
            assert sorted(i.name for i in store.list("np")) == ["np", "np-other", "np/child"]
        else:
            assert nested.error is not None and nested.size is None
            assert store.get("np") == b"object", "a refused nested put must not damage the object"
            assert store.get("np/child") is None
            (over,) = store.put_many([("np", b"again")])
            assert over.ok and store.get("np") == b"again"
            store.delete("np")  # and the other way round: an object cannot replace a "directory"
            store.put("np/child", b"child")
            (clash,) = store.put_many([("np", b"object")])
            assert clash.error is not None and store.get("np/child") == b"child"
            assert store.get("np") is None

    # ---- list -----------------------------------------------------------------------------
    def _fill(self, store: ObjectStore) -> dict[str, int]:
        sizes = {"a/x": 2, "a/y/z": 3, "ab": 4, "a-b": 5, "b/c": 7, "c": 1}
        store.put_many([(n, payload(s, s)) for n, s in sizes.items()])
        return sizes

    def test_list_everything_with_sizes(self, store: ObjectStore) -> None:
        sizes = self._fill(store)
        infos = list(store.list())
        assert all(isinstance(i, ObjectInfo) for i in infos)
        assert {i.name: i.size for i in infos} == sizes
        assert len(infos) == len(sizes), "each object is listed once"

    def test_list_prefix_is_a_plain_string_prefix(self, store: ObjectStore) -> None:
        self._fill(store)
        assert sorted(i.name for i in store.list("a")) == ["a-b", "a/x", "a/y/z", "ab"]
        assert sorted(i.name for i in store.list("a/")) == ["a/x", "a/y/z"]
        assert sorted(i.name for i in store.list("a/y")) == ["a/y/z"]
        assert sorted(i.name for i in store.list("b/c")) == ["b/c"]
        assert list(store.list("zzz")) == []
        assert list(store.list("a/x/more")) == []

    def test_list_pagination(self, store: ObjectStore) -> None:
        names = [f"p/{i:03d}" for i in range(11)]
        store.put_many([(n, b"x") for n in names])
        assert sorted(i.name for i in store.list(page_size=3)) == names
        assert sorted(i.name for i in store.list("p/", page_size=1)) == names
        assert sorted(i.name for i in store.list("p/01", page_size=4)) == names[10:11]

    def test_list_is_lazy(self, store: ObjectStore) -> None:
        store.put_many([(f"l/{i}", b"x") for i in range(5)])
        it = store.list(page_size=2)
        assert isinstance(it, Iterator) and not isinstance(it, list | tuple)
        first = next(it)
        assert first.name.startswith("l/")
        assert len([first, *it]) == 5

    @requires("lists_sorted")
    def test_list_sorted(self, store: ObjectStore) -> None:
        if not self.lists_sorted:
            pytest.skip(f"{type(self).__name__} declares lists_sorted = False")
        self._fill(store)
        store.put("ü", b"u")
        names = [i.name for i in store.list(page_size=2)]
        assert names == sorted(names)
        assert names == sorted(names, key=lambda n: n.encode("utf-8")), "code point order = UTF-8 byte order"

    # ---- invalid names --------------------------------------------------------------------
    @pytest.mark.parametrize("bad", INVALID_NAMES, ids=lambda b: repr(b)[:20])
    def test_invalid_names_are_refused_before_writing(self, store: ObjectStore, bad: str) -> None:
        with pytest.raises(InvalidKeyError):
            store.put_many([("fine-before", b"1"), (bad, b"2"), ("fine-after", b"3")])
        assert list(store.list()) == [], "nothing of a refused batch may be written"
        for verb in (store.get_many, store.head_many, store.delete_many):
            with pytest.raises(InvalidKeyError):
                verb(["fine", bad])

    def test_non_string_name_refused(self, store: ObjectStore) -> None:
        with pytest.raises(InvalidKeyError):
            store.put_many([(b"bytes-name", b"1")])  # type: ignore[list-item]
        assert list(store.list()) == []

    # ---- lifecycle ------------------------------------------------------------------------
    def test_close_is_idempotent(self, store: ObjectStore) -> None:
        store.close()
        store.close()

    @requires("supports_reopen")
    def test_reopen_sees_data(self, store: ObjectStore) -> None:
        if not self.supports_reopen:
            pytest.skip(f"{type(self).__name__} declares supports_reopen = False")
        data = payload(65_537, 9)
        store.put_many([("persist/1", data), ("persist/2", b"")])
        again = self.reopen(store)
        try:
            assert again.get("persist/1") == data
            assert again.head("persist/2") == 0
            assert sorted(i.name for i in again.list()) == ["persist/1", "persist/2"]
        finally:
            again.close()

    # ---- concurrency ----------------------------------------------------------------------
    def test_concurrent_writers_of_one_name(self, store: ObjectStore) -> None:
        """Writers racing on one name leave one complete value; readers never see a mix."""
        size, writers, rounds = 256 * 1024, 4, 3
        values = [bytes([w + 1]) * size for w in range(writers)]
        errors: list[BaseException] = []
        torn: list[str] = []
        stop = threading.Event()

        def write(w: int) -> None:
            try:
                for _ in range(rounds):
                    store.put("race", values[w])
            except BaseException as e:  # surfaced by the assertion below
                errors.append(e)

        def read() -> None:
            try:
                while not stop.is_set():
                    got = store.get("race")
                    if got is not None and got not in values:
                        torn.append(f"read {len(got)} bytes that match no single writer")
            except BaseException as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        reader.join()
        assert errors == []
        assert torn == []
        assert store.get("race") in values
        assert [(i.name, i.size) for i in store.list()] == [("race", size)]


    # ---- the served-bytes invariant ------------------------------------------------------------
    @requires("checks_served_bytes")
    @pytest.mark.parametrize("read_ahead", [False, True], ids=["direct", "read_ahead"])
    @pytest.mark.parametrize("encrypted", [False, True], ids=["sealed", "encrypted"])
    def test_every_found_load_is_the_last_stored_bytes(self, store: ObjectStore, encrypted: bool,
                                                       read_ahead: bool) -> None:
        """Loads at random moments around lookups, read-aheads, decryption, puts and deletes of
        the same names: every hit is the bytes stored last before it began (or of a write that
        overlapped it), never other bytes (docs/integrity.md, "Every byte served is the byte
        verified")."""
        rounds, seed, chunk_kib = settings_from_env()
        tally = run_cell(store, encrypted=encrypted, read_ahead=read_ahead, rounds=rounds, seed=seed,
                         chunk_kib=chunk_kib, cell=f"{type(self).__name__} encrypted={encrypted} "
                                                   f"read_ahead={read_ahead}")
        print(f"served-bytes {type(self).__name__} encrypted={encrypted} read_ahead={read_ahead}: "
              f"{tally.loads} loads, {tally.found} found, {len(tally.wrong)} wrong")
        assert tally.wrong == [], "\n".join(tally.wrong[:10])
        assert tally.found > 0  # the check saw hits, not only misses

    @requires("checks_served_bytes")
    def test_damage_at_rest_and_on_the_wire_deletes_no_valid_chunk(self, store: ObjectStore) -> None:
        """The same rounds with damage (issue 39): objects damaged in storage, 10% of reads damaged
        on the wire, evictions by version; no wrong bytes served, no good chunk deleted (a refusal
        removes only what it read damaged twice, by version; an eviction only what it saw)."""
        rounds, seed, chunk_kib = settings_from_env()
        tally = run_cell(store, encrypted=False, read_ahead=True, rounds=rounds, seed=seed,
                         chunk_kib=chunk_kib, cell=f"{type(self).__name__} damage", damage=0.1)
        print(f"served-bytes {type(self).__name__} damage: {tally.loads} loads, {tally.found} found, "
              f"{len(tally.wrong)} wrong, {tally.damaged} damaged at rest, {tally.evicted} evicted "
              f"({tally.evictions_kept} kept: written since), {len(tally.valid_deleted)} good chunks deleted")
        assert tally.wrong == [], "\n".join(tally.wrong[:10])
        if self.deletes_conditionally:
            assert tally.valid_deleted == [], "\n".join(tally.valid_deleted[:10])
        assert tally.found > 0 and tally.damaged > 0
