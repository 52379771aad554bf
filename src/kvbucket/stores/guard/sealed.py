"""SealedStore: the one place where persistent tiers seal what they write and verify what they read.

Wrapping any :class:`ObjectStore` (``seal_store(store, tier=...)``), it stores every object in
the chunk envelope (:mod:`kvbucket.envelope`) and checks every object read before the caller
gets a byte of it (:mod:`kvbucket.stores.guard.envelope_open`): a failed check is a *miss*, counted
in ``kvbucket_integrity_failures_total{tier,reason}``, and removed from the store only when its
own bytes prove it damaged (:mod:`kvbucket.stores.guard.refusals`, the one rule of what a reader may
delete): an object this reader cannot open (no keyring, another key, layout or format) stays
for the readers that can.

Loads into caller buffers stay copy-free: the header goes to a 64-byte buffer and the payload
straight into the caller's buffer in one scatter read (:class:`Scatter`). The checksum is fed
from each frame as it lands in order (in cache); an encrypted payload is hashed block by block
as it is decrypted in place (docs/integrity.md, "Cost", says what this costs and why).
Sizes reported by ``head_many``/``list``/``delete_many`` are payload sizes, so a lookup that
compares sizes refuses truncated objects without reading them.

Objects without an envelope (written before sealing, or by another program) follow ``unsealed``:
``"miss"`` (the default: never served, never removed by a read) or
``"accept"`` (served as they are, size-checked only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from kvbucket import envelope as env
from kvbucket.chunks import as_view
from kvbucket.did_you_mean import did_you_mean
from kvbucket.encryption import Keyring, encrypt_into
from kvbucket.errors import ConfigError, SizeMismatchError, StoreError
from kvbucket.stores.base import (
    Buffer,
    Gather,
    ItemResult,
    ObjectInfo,
    ObjectStore,
    Scatter,
    check_buffer_size,
)
from kvbucket.stores.deadline import Abandoned, start_refusal
from kvbucket.stores.guard.decrypting_reads import get_decrypting
from kvbucket.stores.guard.envelope_open import EnvelopeOpener, inspect_object, tenant_of_name
from kvbucket.stores.guard.refusals import INTEGRITY_FAILURES, INTEGRITY_REMOVED, INTEGRITY_VERIFIED, Refusals

UNSEALED_POLICIES = ("miss", "accept")


class SealedStore(EnvelopeOpener, ObjectStore):
    """Envelope on write, verification on read, over any store (see the module docstring)."""

    sealed = True

    def __init__(
        self,
        inner: ObjectStore,
        *,
        tier: str,
        identity: str | bytes | None = None,
        unsealed: str = "miss",
        keyring: Keyring | None = None,
        tenant_of: Callable[[str], str] = tenant_of_name,
    ) -> None:
        if unsealed not in UNSEALED_POLICIES:
            raise ConfigError(f"unsealed must be one of {', '.join(UNSEALED_POLICIES)}, got {unsealed!r}; "
                              f"{did_you_mean(unsealed, UNSEALED_POLICIES)}".rstrip("; "))
        self.inner = inner
        self.url = inner.url
        self.tier = tier
        self.identity = env.identity_digest(identity)
        self.unsealed = unsealed
        self.keyring = keyring
        self.tenant_of = tenant_of
        self.overhead = env.HEADER_SIZE + (env.TAG_SIZE if keyring is not None else 0)
        self._verified = INTEGRITY_VERIFIED.labels(tier)  # labels() is slow: once per store, not per load
        self.refusals = Refusals(tier, self.url, judge=self._open_whole)
        rechecks = getattr(inner, "rechecks", None)  # a Hub store's writer-side re-checks (duck-typed:
        if hasattr(rechecks, "verify_with"):  # guard/ imports no store family): never add back damage
            rechecks.verify_with(self._intact)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (during __init__ or unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        crypt = ", encrypted" if self.keyring is not None else ""
        return f"SealedStore({self.inner!r}, tier={self.tier!r}{crypt})"

    def _intact(self, name: str, data: memoryview) -> bool:
        """Whether ``data`` opens as ``name``'s envelope: what a Hub writer's re-check asks before
        adding back what it wrote (stores/hub/rechecks.py)."""
        try:
            self._open_whole(name, data)
        except env.EnvelopeError:
            return False
        return True

    # ---- write --------------------------------------------------------------------------
    def seal(self, name: str, data: Buffer | Gather) -> bytes | np.ndarray | Gather:
        """The envelope bytes of ``data`` stored under ``name`` (at most one copy of the payload).

        Without encryption the payload is hashed where it lies. A store that ``gathers`` (a
        directory, a Hub bucket) gets header + the caller's regions as a :class:`Gather`, with no
        copy: a directory writes it with one ``writev``; a bucket joins each object just before
        handing it to its uploader, so the copy of one object overlaps the upload of the one
        before. Other stores get one new buffer (one copy, made without the GIL: :func:`_joined`).
        """
        if self.keyring is None:
            parts = data.parts if isinstance(data, Gather) else (as_view(data),)
            identity = self.identity

            def header(payload: tuple[memoryview, ...]) -> bytes:
                h = xxhash.xxh3_64()
                for part in payload:
                    h.update(part)
                return env.pack_header(sum(p.nbytes for p in payload), h.intdigest(), name, identity)

            if getattr(self.inner, "gathers", False):  # hashed when the store takes it (Gather.headed)
                return Gather.headed(env.HEADER_SIZE, header, *parts)
            return _joined(header(parts), parts)
        if isinstance(data, Gather):
            data = data.join()
        view = as_view(data)
        n = view.nbytes
        tenant = self.tenant_of(name)
        kid = self.keyring.write_key_id(tenant)
        if kid is None:
            raise StoreError(
                f"encryption is on but the keyring has no key for tenant {tenant!r} (nor a '*' key); "
                "add one to the keyring"
            )
        blob = np.empty(env.HEADER_SIZE + n + env.TAG_SIZE, dtype=np.uint8)
        bv = memoryview(blob)
        nonce = os.urandom(12)
        enc = self.keyring.encryptor(tenant, kid, nonce, env.aad(name, self.identity))
        h = xxhash.xxh3_64()
        encrypt_into(enc, view, bv[env.HEADER_SIZE :], h)
        bv[: env.HEADER_SIZE] = env.pack_header(n + env.TAG_SIZE, h.intdigest(), name, self.identity,
                                                key_id=kid, nonce=nonce)
        return blob

    def put_many(self, items: Sequence[tuple[str, Buffer | Gather]]) -> list[ItemResult]:
        names = self._names([n for n, _ in items])
        results: list[ItemResult | None] = [None] * len(names)
        todo: list[int] = []
        blobs: list[tuple[str, Buffer | Gather]] = []
        sizes: list[int] = []
        for i, (name, (_, data)) in enumerate(zip(names, items, strict=True)):
            try:
                blob = self.seal(name, data)
            except StoreError as e:
                results[i] = ItemResult(name, error=e)
                continue
            todo.append(i)
            blobs.append((name, blob))
            sizes.append((len(blob) if isinstance(blob, bytes) else blob.nbytes) - self.overhead)
        for i, size, r in zip(todo, sizes, self.inner.put_many(blobs) if blobs else [], strict=True):
            results[i] = r if r.error is not None else ItemResult(r.name, size=size, version=r.version)
        return [r for r in results if r is not None]

    # ---- read ---------------------------------------------------------------------------
    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        names = self._names(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        if self.keyring is not None and out is not None and hasattr(self.inner, "get_each"):
            return get_decrypting(self, names, out)
        inner_out: list[Buffer | None] | None = None
        if out is not None and any(b is not None for b in out):
            inner_out = [None if b is None else self._scatter(names[i], b) for i, b in enumerate(out)]
        try:
            results = self.inner.get_many(names, inner_out)
        finally:
            # The gate (docs/integrity.md, "Every byte served is the byte verified"): the read is
            # over, so a redirect (a load taking a read-ahead on its way) is refused from here on
            # and every stage below checks or decrypts the bytes where they now stay, in the
            # buffer whose result it becomes. Each is settled once its stages are done.
            for dst in inner_out or ():
                if dst is not None:
                    dst.close()
        final: list[ItemResult] = []
        bad: list[tuple[str, env.EnvelopeError]] = []
        sized: list[int] = []
        try:
            for i, (name, r) in enumerate(zip(names, results, strict=True)):
                dst = inner_out[i] if inner_out is not None else None
                final.append(self._open_one(i, name, r, dst, out, sized, bad))
                if dst is not None:
                    dst.settle()
        finally:
            for dst in inner_out or ():
                if dst is not None:
                    dst.settle()
        return self._conclude(names, out, sized, final, bad)  # type: ignore[arg-type]

    def _open_one(self, i: int, name: str, r: ItemResult, dst: Scatter | None,
                  out: Sequence[Buffer | None] | None, sized: list[int],
                  bad: list[tuple[str, env.EnvelopeError]]) -> ItemResult:
        """The verified result of item ``i`` of a load (read into ``dst`` when not None)."""
        if r.error is not None:
            if dst is not None and isinstance(r.error, SizeMismatchError):
                sized.append(i)
            return r
        if r.size is None:
            return r
        try:
            if dst is None:
                return self._open_whole(name, r.data)
            assert out is not None
            self._open_scattered(name, dst)
            return ItemResult(name, size=dst.nbytes - self.overhead, data=out[i])
        except env.EnvelopeError as e:
            if e.reason == "unsealed" and self.unsealed == "accept" and dst is None:
                return r
            bad.append((name, e))
            return ItemResult(name)

    def _conclude(self, names: list[str], out: Sequence[Buffer | None], sized: list[int],
                  final: list[ItemResult], bad: list[tuple[str, env.EnvelopeError]]) -> list[ItemResult]:
        """End of every verified load: classify size mismatches, refuse the bad, count the good."""
        if sized:
            self._classify_sizes(names, out, sized, final, bad)
        if bad:
            self._serve_again(names, out, final, self._refuse(bad))
        ok = sum(1 for r in final if r.found)
        if ok:
            self._verified.inc(ok)
        return final

    def _classify_sizes(
        self, names: list[str], out: Sequence[Buffer | None], idxs: list[int], final: list[ItemResult],
        bad: list[tuple[str, env.EnvelopeError]],
    ) -> None:
        """Scatter reads refused for their size (rare): read those objects whole to say why
        (unsealed, truncated, another length, another key mode), or accept unsealed ones."""
        got = self.inner.get_many([names[i] for i in idxs])
        accept: list[int] = []
        for i, r in zip(idxs, got, strict=True):
            name = names[i]
            if r.error is not None or r.size is None:
                final[i] = r
                continue
            n = len(out[i]) if isinstance(out[i], Scatter) else as_view(out[i]).nbytes
            view = memoryview(r.data)
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            try:
                if not env.is_sealed(view):
                    raise env.EnvelopeError("unsealed", f"{name}: no kvbucket envelope")
                header = self._check_header(view[: env.HEADER_SIZE], name)
                env.check_payload(header, view[env.HEADER_SIZE :], name)
            except env.EnvelopeError as e:
                if e.reason == "unsealed" and self.unsealed == "accept" and r.size == n:
                    accept.append(i)
                    continue
                bad.append((name, e))
                final[i] = ItemResult(name)
                continue
            # A good chunk, only of another size than the caller's buffer: not damage, so it is
            # kept, and reported as the stores report sizes (the buffer was not written).
            stored = header.payload_len - (env.TAG_SIZE if header.encrypted else 0)
            final[i] = ItemResult(name, error=SizeMismatchError(
                f"object {name!r} has {stored} bytes but the buffer given for it has {n}"))
        if accept:
            for i, r in zip(accept, self.inner.get_many([names[i] for i in accept], [out[i] for i in accept]),
                            strict=True):
                final[i] = r

    def _refuse(self, bad: list[tuple[str, env.EnvelopeError]]) -> dict[str, ItemResult]:
        return self.refusals.refuse(self.inner, bad)

    @staticmethod
    def _serve_again(names: list[str], out: Sequence[Buffer | None] | None, final: list[ItemResult],
                     good: dict[str, ItemResult]) -> None:
        """Serve the objects refused as damaged that verified when read again (damage on the wire):
        their verified payload, copied into the caller's buffer when one was given."""
        for i, name in enumerate(names):
            r = good.get(name)
            if r is None or final[i].found or final[i].error is not None:
                continue
            buf = out[i] if out is not None else None
            if buf is None:
                final[i] = r
                continue
            if start_refusal() is not None:  # the re-read ran past the caller's bound: a miss,
                continue  # not a copy after the tier stopped waiting (backends/late_start.py)
            try:
                view = check_buffer_size(name, r.size or 0, buf)
                view[0 : r.size or 0] = r.data
            except (StoreError, Abandoned, ValueError, TypeError):
                continue  # another size now, or a destination closed meanwhile: a miss
            final[i] = ItemResult(name, size=r.size, data=buf)

    def refuse_names(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Count and log objects found bad without a load (e.g. at an index rebuild); removed by the
        one rule (:mod:`kvbucket.stores.guard.refusals`)."""
        self._refuse([(n, env.EnvelopeError(reason, f"{n}: refused ({reason})")) for n, reason in pairs])

    # ---- the rest of the protocol -------------------------------------------------------
    def payload_size(self, size: int | None) -> int | None:
        """The payload size of a stored object of ``size`` bytes."""
        if size is None:
            return None
        # Too small to hold an envelope: reported as it is (never the size of a full chunk, so
        # size-checking lookups refuse it; listings still show it, e.g. as a foreign object).
        return size - self.overhead if size >= self.overhead else size

    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        return [r if r.error is not None
                else ItemResult(r.name, size=self.payload_size(r.size), version=r.version)
                for r in self.inner.head_many(names)]

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return [r if r.error is not None else ItemResult(r.name, size=self.payload_size(r.size))
                for r in self.inner.delete_many(names)]

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        for info in self.inner.list(prefix, page_size=page_size):
            size = info.size - self.overhead if info.size >= self.overhead else info.size
            yield ObjectInfo(info.name, size, info.mtime, info.version)

    def check_headers(self, infos: Sequence[ObjectInfo]) -> list[str | None]:
        """For listed objects (payload sizes), the failure reason of each one's header, None if good.

        Reads only the 64-byte headers, and only when the inner store can read a prefix cheaply
        (a directory); elsewhere every answer is None (unknown until a load). Bad objects are
        refused like a failed load (counted; removed by the one rule).
        """
        reader = getattr(self.inner, "read_prefixes", None)
        if reader is None:
            return [None] * len(infos)
        heads = reader([i.name for i in infos], env.HEADER_SIZE)
        out: list[str | None] = []
        bad: list[tuple[str, env.EnvelopeError]] = []
        for info, head in zip(infos, heads, strict=True):
            try:
                if head is None:
                    raise env.EnvelopeError("truncated", f"{info.name}: unreadable header")
                header = self._check_header(memoryview(head), info.name)
                stored = info.size + self.overhead - env.HEADER_SIZE
                if header.payload_len != stored:
                    reason = "truncated" if stored < header.payload_len else "length"
                    raise env.EnvelopeError(reason, f"{info.name}: {stored} payload bytes stored, "
                                                    f"the header says {header.payload_len}")
            except env.EnvelopeError as e:
                if e.reason == "unsealed" and self.unsealed == "accept":
                    out.append(None)
                    continue
                bad.append((info.name, e))
                out.append(e.reason)
                continue
            out.append(None)
        if bad:
            self._refuse(bad)
        return out

    def close(self) -> None:
        self.inner.close()


def _joined(head: bytes, parts: tuple[memoryview, ...]) -> np.ndarray:
    """``head`` and ``parts`` in one new buffer. numpy copies without the GIL (``b"".join``
    holds it for every byte: 0.47 s per GiB stored, the whole of an S3 store's GIL time)."""
    blob = np.empty(len(head) + sum(p.nbytes for p in parts), dtype=np.uint8)
    blob[: len(head)] = np.frombuffer(head, np.uint8)
    pos = len(head)
    for part in parts:
        np.copyto(blob[pos : pos + part.nbytes], np.frombuffer(part, np.uint8))
        pos += part.nbytes
    return blob


def seal_store(
    store: ObjectStore,
    *,
    tier: str,
    identity: str | bytes | None = None,
    unsealed: str = "miss",
    encryption: Any = None,
) -> SealedStore:
    """Wrap ``store`` in a :class:`SealedStore` unless it already is one (then it is returned as is).

    ``encryption`` is an ``encryption`` setting (None/False, True, a mapping with
    ``keyring_file``/``keyring_env``) or a :class:`Keyring`.
    """
    if isinstance(store, SealedStore):
        return store
    return SealedStore(store, tier=tier, identity=identity, unsealed=unsealed,
                       keyring=Keyring.from_setting(encryption))


__all__ = [
    "INTEGRITY_FAILURES",
    "INTEGRITY_REMOVED",
    "INTEGRITY_VERIFIED",
    "UNSEALED_POLICIES",
    "SealedStore",
    "inspect_object",
    "seal_store",
    "tenant_of_name",
]
