"""FileStore against a dict model: random sequences of puts, deletes, reads and listings."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvbucket.stores.local.file import FileStore

# A small alphabet so that names collide, nest and share prefixes often.
segment = st.sampled_from(["a", "b", "a-b", "é", "%2F", "x@1"])
names = st.lists(segment, min_size=1, max_size=3).map("/".join)
payloads = st.binary(max_size=64)


def _conflicts(model: dict[str, bytes], name: str) -> bool:
    """A directory tree cannot hold ``name`` if it is a directory of, or below, another object."""
    return any(other.startswith(name + "/") or name.startswith(other + "/") for other in model)


class FileStoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvbucket-model-")
        self.store = FileStore(self.dir)
        self.model: dict[str, bytes] = {}

    @rule(items=st.lists(st.tuples(names, payloads), max_size=4))
    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        results = self.store.put_many(items)
        for (n, data), r in zip(items, results, strict=True):
            assert r.name == n
            if _conflicts(self.model, n):
                assert r.error is not None and r.size is None
            else:
                assert r.ok and r.size == len(data)
                self.model[n] = data

    @rule(batch=st.lists(names, max_size=4))
    def delete_many(self, batch: list[str]) -> None:
        for r in self.store.delete_many(batch):
            expected = self.model.pop(r.name, None)
            assert r.ok and r.size == (None if expected is None else len(expected))

    @rule(batch=st.lists(names, max_size=4))
    def get_and_head(self, batch: list[str]) -> None:
        for r, h in zip(self.store.get_many(batch), self.store.head_many(batch), strict=True):
            want = self.model.get(r.name)
            assert r.ok and h.ok
            assert (None if r.data is None else bytes(r.data)) == want
            assert h.size == (None if want is None else len(want))

    @rule(prefix=st.one_of(st.just(""), names, names.map(lambda n: n[:-1])))
    def list_prefix(self, prefix: str) -> None:
        got = [(i.name, i.size) for i in self.store.list(prefix, page_size=2)]
        assert got == sorted((n, len(d)) for n, d in self.model.items() if n.startswith(prefix))

    @invariant()
    def no_temp_files_linger(self) -> None:
        assert not any(True for _ in (self.store.root / ".kvbucket-tmp").glob("*"))

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


FileStoreModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestFileStoreModel = FileStoreModel.TestCase
