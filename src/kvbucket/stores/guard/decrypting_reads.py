"""Encrypted loads from a directory: read object by object into scratch, decrypted one-shot.

The path :meth:`SealedStore.get_many <kvbucket.stores.guard.sealed.SealedStore.get_many>` takes for an
encrypted store whose inner store reads object by object (``get_each``: :class:`FileStore`).
docs/integrity.md, "Cost", says what it saves and what was measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvbucket import envelope as env
from kvbucket.chunks import as_view
from kvbucket.encryption import HANDOFF_MIN, Handoff, scratch, spare_cores
from kvbucket.errors import SizeMismatchError, StoreError
from kvbucket.stores.base import Buffer, ItemResult, Scatter


class SealedReads(Protocol):
    """What this path uses of :class:`~kvbucket.stores.guard.sealed.SealedStore`, which imports this
    module (typed here, so the import runs one way)."""

    inner: Any  # an ObjectStore with get_each (FileStore)
    unsealed: str

    def _open_whole(self, name: str, data: Buffer) -> ItemResult: ...

    def _check_header(self, head: memoryview, name: str) -> env.Header: ...

    def _decrypt_into(self, name: str, header: env.Header, payload: memoryview, dst: memoryview) -> None: ...

    def _conclude(self, names: list[str], out: Sequence[Buffer | None], sized: list[int],
                  final: list[ItemResult], bad: list[tuple[str, env.EnvelopeError]]) -> list[ItemResult]: ...


def get_decrypting(store: SealedReads, names: list[str], out: Sequence[Buffer | None]) -> list[ItemResult]:
    """Encrypted loads from a store that reads object by object (a directory: ``get_each``).

    Each object (header, ciphertext and tag) is read into a scratch buffer reused for the
    whole batch (warm in cache), and decrypted from there into the caller's buffer by the
    one-shot AES-GCM (``decrypt_into``) right after it landed. The GCM tag authenticates
    every byte, so the xxh3 checksum is computed only when decryption fails, to say why
    (``checksum``: the stored bytes changed; ``decrypt``: another key or tampering).

    Objects of :data:`HANDOFF_MIN` bytes or more alternate between two scratch buffers and
    are decrypted by a helper thread while the next one is read (:class:`Handoff`); once the
    helper falls behind (no idle core), the rest of the batch is decrypted here, in order.
    """
    views: list[memoryview | None] = []
    for name, b in zip(names, out, strict=True):
        if b is None:
            views.append(None)
            continue
        try:
            v = as_view(b)  # numpy arrays and CPU torch tensors too (memoryview() refuses tensors)
            if v.readonly:
                raise ValueError("it is read-only")
            views.append(v)
        except (ValueError, TypeError) as e:
            raise StoreError(f"the buffer given for {name!r} cannot be read into: {e}") from None
    largest = max((v.nbytes for v in views if v is not None), default=0)
    handing_off = largest >= HANDOFF_MIN and spare_cores()
    room = env.HEADER_SIZE + largest + env.TAG_SIZE
    spaces = [scratch(room, 0), scratch(room, 1) if handing_off else scratch(room, 0)]
    dests: list[Buffer | None] = [
        None if v is None else Scatter(spaces[i & 1][: env.HEADER_SIZE + v.nbytes + env.TAG_SIZE])
        for i, v in enumerate(views)]
    bad: list[tuple[str, env.EnvelopeError]] = []
    sized: list[int] = []
    pending: list[tuple[int, Handoff] | None] = [None, None]  # per scratch slot
    late: dict[int, ItemResult] = {}  # results of handed-off objects whose decryption failed

    def settle(slot: int) -> None:
        """Finish the decryption still using scratch ``slot`` (it is about to be read into)."""
        nonlocal handing_off
        job = pending[slot]
        if job is None:
            return
        pending[slot] = None
        i, handoff = job
        try:
            if handoff.finish():
                handing_off = False  # the helper did not get to it in time: no core to spare
        except env.EnvelopeError as e:
            bad.append((names[i], e))
            late[i] = ItemResult(names[i])

    def opened(i: int, r: ItemResult) -> ItemResult:
        name, view = names[i], views[i]
        settle((i + 1) & 1)  # the next object is read into that slot
        if r.error is not None:
            if view is not None and isinstance(r.error, SizeMismatchError):
                sized.append(i)
            return r
        if r.size is None:
            return r
        try:
            if view is None:
                return store._open_whole(name, r.data)
            data = spaces[i & 1][: env.HEADER_SIZE + view.nbytes + env.TAG_SIZE]
            header = store._check_header(data[: env.HEADER_SIZE], name)
            payload = data[env.HEADER_SIZE :]
            if header.payload_len != payload.nbytes:
                raise env.EnvelopeError("length", f"{name}: the header says {header.payload_len} "
                                                  f"payload bytes, {payload.nbytes} were read")
            if handing_off and i + 1 < len(names) and view.nbytes >= HANDOFF_MIN:
                pending[i & 1] = (i, Handoff(lambda: store._decrypt_into(name, header, payload, view)))
            else:
                store._decrypt_into(name, header, payload, view)
            return ItemResult(name, size=view.nbytes, data=out[i])
        except env.EnvelopeError as e:
            if e.reason == "unsealed" and store.unsealed == "accept" and view is None:
                return r
            bad.append((name, e))
            return ItemResult(name)

    try:
        final = store.inner.get_each(names, dests, opened)
    finally:
        settle(0)  # never return (or raise) while a helper still writes a caller's buffer
        settle(1)
    for i, r in late.items():
        final[i] = r
    return store._conclude(names, out, sized, final, bad)


__all__ = ["get_decrypting"]
