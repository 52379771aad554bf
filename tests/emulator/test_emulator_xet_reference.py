"""The emulator's faster verification still computes exactly the Xet hashes (reference forms)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbucket.testing.hub_emulator.state import State, preallocate
from kvbucket.testing.hub_emulator.xet import (
    DATA_KEY,
    INTERNAL_NODE_KEY,
    XetFormatError,
    hash_to_hex,
    merkle_root,
    verify_xorb,
    verify_xorb_file,
)


def _hex_reference(h: bytes) -> str:
    return "".join(h[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def _merkle_reference(nodes: list[tuple[bytes, int]]) -> bytes:
    """The aggregation as xet-core's docs state it, written for clarity, not speed."""
    if not nodes:
        return bytes(32)
    level = list(nodes)
    while len(level) > 1:
        out, start = [], 0
        while start < len(level):
            remaining = len(level) - start
            cut = len(level)
            if remaining > 2:
                end = min(9, remaining)
                cut = start + end
                for i in range(2, end):
                    if int.from_bytes(level[start + i][0][24:32], "little") % 4 == 0:
                        cut = start + i + 1
                        break
            group = level[start:cut]
            text = "".join(f"{_hex_reference(h)} : {n}\n" for h, n in group).encode()
            out.append((blake3.blake3(text, key=INTERNAL_NODE_KEY).digest(), sum(n for _, n in group)))
            start = cut
        level = out
    return level[0][0]


@given(st.binary(min_size=32, max_size=32))
def test_hash_to_hex_matches_the_reference_form(h: bytes) -> None:
    assert hash_to_hex(h) == _hex_reference(h)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.integers(1, 1 << 17)), max_size=300))
def test_merkle_root_matches_the_reference(nodes: list[tuple[bytes, int]]) -> None:
    assert merkle_root(nodes) == _merkle_reference(nodes)


def _xorb(chunks: list[bytes]) -> tuple[bytes, str]:
    body = b"".join(
        bytes([0]) + len(c).to_bytes(3, "little") + bytes([0]) + len(c).to_bytes(3, "little") + c
        for c in chunks
    )
    nodes = [(blake3.blake3(c, key=DATA_KEY).digest(), len(c)) for c in chunks]
    return body, hash_to_hex(_merkle_reference(nodes))


def test_verify_xorb_file_recomputes_every_chunk(tmp_path: Path) -> None:
    chunks = [os.urandom(4096 + i) for i in range(40)]
    body, good = _xorb(chunks)
    path = tmp_path / "x"
    path.write_bytes(body)
    idx = verify_xorb_file(str(path), good)
    assert idx.unpacked_lens == [len(c) for c in chunks] and idx.byte_offsets[-1] == len(body)
    flipped = bytearray(body)
    flipped[-1] ^= 1  # one bit in the last chunk's payload
    path.write_bytes(bytes(flipped))
    with pytest.raises(XetFormatError, match="hashes to"):
        verify_xorb_file(str(path), good)
    with pytest.raises(XetFormatError, match="version"):
        verify_xorb(b"\x01" + body[1:], good)


def test_preallocated_xorb_is_stored_whole_and_exact(tmp_path: Path) -> None:
    state = State(tmp_path)
    try:
        body, hx = _xorb([os.urandom(10_000), os.urandom(7)])
        assert state.put_xorb(verify_xorb(body, hx), body)
        stored = state.xorb_path(hx)
        assert stored.read_bytes() == body  # no preallocated tail beyond the body
        assert stored.stat().st_mode & 0o777 == 0o600
        assert not [p for p in stored.parent.iterdir() if p.name.startswith(".tmp-")]
    finally:
        state.close()


def test_preallocate_sets_the_size_and_ignores_nonsense(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as f:
        preallocate(f.fileno(), 0)
        assert os.fstat(f.fileno()).st_size == 0
        preallocate(f.fileno(), 1 << 20)
        assert os.fstat(f.fileno()).st_size == 1 << 20
