"""Manifest objects that are not manifests (an outside check of issue 38): a JSON array, a
non-string weights field, bytes that are not JSON. Readers say 'unreadable' instead of crashing
the identity check's thread or showing the identity as having no manifest."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from kvbucket.identity.core import ModelIdentity
from kvbucket.identity.manifest import Manifest, manifest_name
from kvbucket.identity.usage import Generations
from kvbucket.stores.local.memory import MemoryStore

MODEL = "meta-llama/Llama-3.1-8B"
OTHERS = {
    "5555666677778888": b"[1,2,3]",
    "9999aaaabbbbcccc": json.dumps({"weights": ["x"]}).encode(),
    "1111222233334444": b"\x00\xffnot json{{",
    "aaaabbbbccccdddd": json.dumps({"weights": "files:ab"}).encode(),
}


def _store() -> MemoryStore:
    store = MemoryStore("manifests")
    store.put_many([(manifest_name("us", MODEL, token), body) for token, body in OTHERS.items()])
    return store


def test_the_identity_check_reads_foreign_manifests_without_crashing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        m = Manifest(_store(), "us", ModelIdentity(MODEL, "files:00"), "test tier")
        with caplog.at_level(logging.WARNING):
            m.start()
            assert m.checked.wait(10)
    finally:
        threading.excepthook = old_hook
    assert not errors, errors
    text = caplog.text
    assert "5555666677778888 (manifest unreadable)" in text  # a JSON array
    assert "1111222233334444 (manifest unreadable)" in text  # not JSON
    assert "9999aaaabbbbcccc (weights unknown)" in text and "['x']" not in text  # not a string
    assert "aaaabbbbccccdddd (files:ab)" in text


def test_du_tells_an_unreadable_manifest_from_a_missing_one() -> None:
    store = _store()
    gens = Generations()
    for info in store.list(""):
        gens.add(info)
    gens.read_manifests(store)
    by_token = {g.token: g.to_dict() for g in gens.sorted()}
    assert by_token["5555666677778888"]["manifest"] == "unreadable"
    assert by_token["1111222233334444"]["manifest"] == "unreadable"
    assert by_token["aaaabbbbccccdddd"]["manifest"] == "ok"
    assert by_token["aaaabbbbccccdddd"]["weights"] == "files:ab"
    assert by_token["9999aaaabbbbcccc"]["weights"] is None
