"""SealedStore: the one place where persistent tiers seal what they write and verify what they read.

Wrapping any :class:`ObjectStore` (``seal_store(store, tier=...)``), it stores every object in
the chunk envelope (:mod:`kvbucket.envelope`) and checks every object read before the caller
gets a byte of it: a failed check is a *miss*, the object is removed from that store (so it is
recomputed and rewritten), counted in ``kvbucket_integrity_failures_total{tier,reason}`` and
logged once per object at WARNING with its name (never its bytes).

Loads into caller buffers stay copy-free: the header goes to a 64-byte buffer and the payload
straight into the caller's buffer in one scatter read (:class:`Scatter`). The checksum is fed
from each frame as it lands in order (in cache); an encrypted payload is hashed block by block
as it is decrypted in place (docs/integrity.md, "Cost", says what this costs and why).
Sizes reported by ``head_many``/``list``/``delete_many`` are payload sizes, so a lookup that
compares sizes refuses truncated objects without reading them.

Objects without an envelope (written before sealing, or by another program) follow ``unsealed``:
``"miss"`` (the default: never served; removed only when ``delete_unsealed``, i.e. in a tier's
private directory) or ``"accept"`` (served as they are, size-checked only).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash
from prometheus_client import Counter

from kvbucket import envelope as env
from kvbucket.chunks import as_view
from kvbucket.encryption import BLOCK as _BLOCK
from kvbucket.encryption import (
    HANDOFF_MIN,
    Handoff,
    Keyring,
    decrypt_in_place,
    encrypt_into,
    scratch,
    spare_cores,
)
from kvbucket.errors import ConfigError, SizeMismatchError, StoreError
from kvbucket.keys import decode_key
from kvbucket.stores.base import Buffer, Gather, ItemResult, ObjectInfo, ObjectStore, Scatter

log = logging.getLogger(__name__)

UNSEALED_POLICIES = ("miss", "accept")

INTEGRITY_FAILURES = Counter(
    "kvbucket_integrity_failures",
    "Stored objects refused on read (served as a miss, removed from the tier), by tier and reason "
    "(checksum, truncated, length, header, version, name, identity, key, decrypt, unsealed).",
    ["tier", "reason"],
)
INTEGRITY_VERIFIED = Counter(
    "kvbucket_integrity_verified",
    "Stored objects whose envelope verified on read before the caller got them, by tier.",
    ["tier"],
)
_LOGGED_MAX = 10000


def tenant_of_name(name: str) -> str:
    """The tenant (``cache_salt``) of a chunk's object name; ``""`` when it has none.

    MP-mode keys (``model@rank@hash@salt``) carry the salt as their fourth field; non-MP keys
    may carry a ``tenant%<id>`` (the transformers integration) or ``...cache_salt%<salt>``
    request config.
    """
    seg = name.rsplit("/", 1)[-1]
    try:
        key = decode_key(seg)
    except ValueError:
        return ""
    parts = key.split("@")
    if len(parts) == 4:
        return parts[3]
    for extra in parts[5:]:
        k, _, v = extra.partition("%")
        if k == "tenant" or k.endswith("cache_salt"):
            return v
    return ""


class SealedStore(ObjectStore):
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
        delete_unsealed: bool = False,
    ) -> None:
        if unsealed not in UNSEALED_POLICIES:
            raise ConfigError(f"unsealed must be one of {', '.join(UNSEALED_POLICIES)}, got {unsealed!r}")
        self.inner = inner
        self.url = inner.url
        self.tier = tier
        self.identity = env.identity_digest(identity)
        self.unsealed = unsealed
        self.keyring = keyring
        self.tenant_of = tenant_of
        self.delete_unsealed = delete_unsealed
        self.overhead = env.HEADER_SIZE + (env.TAG_SIZE if keyring is not None else 0)
        self._verified = INTEGRITY_VERIFIED.labels(tier)  # labels() is slow: once per store, not per load
        self._logged: set[str] = set()
        self._logged_lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (during __init__ or unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        crypt = ", encrypted" if self.keyring is not None else ""
        return f"SealedStore({self.inner!r}, tier={self.tier!r}{crypt})"

    # ---- write --------------------------------------------------------------------------
    def seal(self, name: str, data: Buffer | Gather) -> np.ndarray | Gather:
        """The envelope bytes of ``data`` stored under ``name`` (one copy of the payload).

        A :class:`Gather` (a caller's regions, e.g. an engine's strided KV page) is hashed where it
        lies and, for a store that ``gathers`` (a directory), returned as header + regions with no
        copy; other stores (and encryption) get it joined.
        """
        if isinstance(data, Gather):
            if self.keyring is None and getattr(self.inner, "gathers", False):
                h = xxhash.xxh3_64()
                for part in data.parts:
                    h.update(part)
                return Gather(env.pack_header(data.nbytes, h.intdigest(), name, self.identity), *data.parts)
            data = data.join()
        view = as_view(data)
        n = view.nbytes
        if self.keyring is None:
            blob = np.empty(env.HEADER_SIZE + n, dtype=np.uint8)
            bv = memoryview(blob)
            h = xxhash.xxh3_64()
            for off in range(0, n, _BLOCK):  # copy and hash each block while it is in cache
                block = view[off : off + _BLOCK]
                bv[env.HEADER_SIZE + off : env.HEADER_SIZE + off + block.nbytes] = block
                h.update(block)
            bv[: env.HEADER_SIZE] = env.pack_header(n, h.intdigest(), name, self.identity)
            return blob
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
            sizes.append(blob.nbytes - self.overhead)
        for i, size, r in zip(todo, sizes, self.inner.put_many(blobs) if blobs else [], strict=True):
            results[i] = r if r.error is not None else ItemResult(r.name, size=size)
        return [r for r in results if r is not None]

    # ---- read ---------------------------------------------------------------------------
    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        names = self._names(names)
        if out is not None and len(out) != len(names):
            raise ValueError(f"get_many got {len(names)} names but {len(out)} buffers")
        if self.keyring is not None and out is not None and hasattr(self.inner, "get_each"):
            return self._get_decrypting(names, out)
        inner_out: list[Buffer | None] | None = None
        if out is not None and any(b is not None for b in out):
            inner_out = [None if b is None else self._scatter(names[i], b) for i, b in enumerate(out)]
        results = self.inner.get_many(names, inner_out)
        final: list[ItemResult] = []
        bad: list[tuple[str, env.EnvelopeError]] = []
        sized: list[int] = []
        for i, (name, r) in enumerate(zip(names, results, strict=True)):
            dst = inner_out[i] if inner_out is not None else None
            if r.error is not None:
                if dst is not None and isinstance(r.error, SizeMismatchError):
                    sized.append(i)
                final.append(r)
                continue
            if r.size is None:
                final.append(r)
                continue
            try:
                if dst is None:
                    final.append(self._open_whole(name, r.data))
                else:
                    assert out is not None
                    self._open_scattered(name, dst)
                    final.append(ItemResult(name, size=dst.nbytes - self.overhead, data=out[i]))
            except env.EnvelopeError as e:
                if e.reason == "unsealed" and self.unsealed == "accept" and dst is None:
                    final.append(r)
                    continue
                bad.append((name, e))
                final.append(ItemResult(name))
        return self._conclude(names, out, sized, final, bad)  # type: ignore[arg-type]

    def _get_decrypting(self, names: list[str], out: Sequence[Buffer | None]) -> list[ItemResult]:
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
                v = memoryview(b)
                if v.readonly or not v.c_contiguous:
                    raise ValueError("read-only" if v.readonly else "not contiguous")
                views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
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
                    return self._open_whole(name, r.data)
                data = spaces[i & 1][: env.HEADER_SIZE + view.nbytes + env.TAG_SIZE]
                header = self._check_header(data[: env.HEADER_SIZE], name)
                payload = data[env.HEADER_SIZE :]
                if header.payload_len != payload.nbytes:
                    raise env.EnvelopeError("length", f"{name}: the header says {header.payload_len} "
                                                      f"payload bytes, {payload.nbytes} were read")
                if handing_off and i + 1 < len(names) and view.nbytes >= HANDOFF_MIN:
                    pending[i & 1] = (i, Handoff(lambda: self._decrypt_into(name, header, payload, view)))
                else:
                    self._decrypt_into(name, header, payload, view)
                return ItemResult(name, size=view.nbytes, data=out[i])
            except env.EnvelopeError as e:
                if e.reason == "unsealed" and self.unsealed == "accept" and view is None:
                    return r
                bad.append((name, e))
                return ItemResult(name)

        try:
            final = self.inner.get_each(names, dests, opened)
        finally:
            settle(0)  # never return (or raise) while a helper still writes a caller's buffer
            settle(1)
        for i, r in late.items():
            final[i] = r
        return self._conclude(names, out, sized, final, bad)

    def _decrypt_into(self, name: str, header: env.Header, payload: memoryview, dst: memoryview) -> None:
        """Decrypt ``payload`` (ciphertext + tag, as stored) into ``dst`` with the one-shot
        AES-GCM; on failure, the checksum says whether the stored bytes changed."""
        from cryptography.exceptions import InvalidTag

        assert self.keyring is not None
        if payload.nbytes < env.TAG_SIZE or dst.nbytes != payload.nbytes - env.TAG_SIZE:
            raise env.EnvelopeError("length", f"{name}: an encrypted payload of {payload.nbytes} bytes "
                                              f"cannot hold {dst.nbytes} bytes and its tag")
        aead = self.keyring.aead(self.tenant_of(name), header.key_id)
        try:
            aead.decrypt_into(header.nonce, payload, env.aad(name, header.identity), dst)
            return
        except InvalidTag:
            pass
        if env.checksum(payload) != header.checksum:
            raise env.EnvelopeError("checksum", f"{name}: the payload's checksum does not match")
        raise env.EnvelopeError("decrypt", f"{name}: decryption failed (wrong key or tampered)")

    def _scatter(self, name: str, buf: Buffer) -> Scatter:
        """The read destination of one object: its header, the caller's buffer, (its GCM tag).

        Plain payloads are hashed as they land in order (in cache, one pass); encrypted ones are
        hashed block by block as they are decrypted (:func:`decrypt_in_place`), so no hasher here.
        """
        parts = buf.parts if isinstance(buf, Scatter) else (buf,)  # a caller's regions: read in place
        if len(parts) != 1 and self.keyring is not None:
            raise StoreError(f"the buffer given for {name!r} has {len(parts)} regions; an encrypted "
                             "store reads into one contiguous buffer")
        try:
            if self.keyring is None:
                return Scatter(bytearray(env.HEADER_SIZE), *parts, hasher=xxhash.xxh3_64(),
                               hash_from=env.HEADER_SIZE)
            return Scatter(bytearray(env.HEADER_SIZE), parts[0], bytearray(env.TAG_SIZE))
        except (ValueError, TypeError) as e:
            raise StoreError(f"the buffer given for {name!r} cannot be read into: {e}") from None

    def _open_whole(self, name: str, data: Buffer) -> ItemResult:
        view = memoryview(data)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes < env.HEADER_SIZE:
            env.parse_header(view, name)  # raises: unsealed, or truncated when it starts sealed
        header = self._check_header(view[: env.HEADER_SIZE], name)
        payload = view[env.HEADER_SIZE :]
        if not header.encrypted:
            env.check_payload(header, payload, name)
            return ItemResult(name, size=payload.nbytes, data=payload.toreadonly())
        env.check_length(header, payload, name)
        plain = bytearray(max(0, payload.nbytes - env.TAG_SIZE))
        self._decrypt_into(name, header, payload, memoryview(plain))
        return ItemResult(name, size=len(plain), data=plain)

    def _open_scattered(self, name: str, dst: Scatter) -> None:
        """Verify (and decrypt) an object read into ``dst``; raise :class:`EnvelopeError`."""
        parts = dst.parts
        header = self._check_header(parts[0], name)
        view = parts[1]  # the payload (of an unencrypted read: its first region)
        encrypted = self.keyring is not None
        stored = dst.nbytes - env.HEADER_SIZE
        if header.payload_len != stored:
            raise env.EnvelopeError(
                "length", f"{name}: the header says {header.payload_len} payload bytes, {stored} were read"
            )
        if encrypted:  # the checksum is fed block by block, in cache, as the payload is decrypted
            self._decrypt(name, header, view, bytes(parts[2]), checksum=header.checksum)
            return
        # The store fed the hash as bytes landed in order (while they were in cache); what did
        # not land in order (unordered downloads) is hashed now, and a rewritten range (a retried
        # transfer) voids the running hash: the whole payload is hashed again.
        if dst.rewritten:
            h = xxhash.xxh3_64()
            for region in parts[1:]:
                h.update(region)
            digest = h.intdigest()
        else:
            if dst.hashed < dst.nbytes:
                dst.landed(dst.hashed, dst.nbytes)
            digest = dst.hasher.intdigest()
        if digest != header.checksum:
            raise env.EnvelopeError("checksum", f"{name}: the payload's checksum does not match")

    def _check_header(self, head: memoryview, name: str) -> env.Header:
        header = env.parse_header(head, name)
        env.check_identity(header, self.identity, name)
        if header.encrypted != (self.keyring is not None):
            why = "is encrypted but no keyring is configured" if header.encrypted else (
                "is not encrypted but encryption is on")
            raise env.EnvelopeError("key", f"{name}: the object {why}")
        if header.encrypted:
            assert self.keyring is not None
            if not self.keyring.has_key(self.tenant_of(name), header.key_id):
                raise env.EnvelopeError("key", f"{name}: key id {header.key_id} is not in the keyring")
        return header

    def _decrypt(self, name: str, header: env.Header, view: memoryview, tag: bytes,
                 checksum: int | None = None) -> None:
        """Decrypt ``view`` in place and check its tag; with ``checksum``, also check the stored
        ciphertext's xxh3-64 (hashed block by block before each block is decrypted), so a damaged
        payload is reported as ``checksum`` rather than ``decrypt``."""
        from cryptography.exceptions import InvalidTag

        assert self.keyring is not None
        if len(tag) != env.TAG_SIZE:  # a payload shorter than a GCM tag (a well-formed header says so)
            raise env.EnvelopeError("length", f"{name}: an encrypted payload shorter than its tag")
        dec = self.keyring.decryptor(self.tenant_of(name), header.key_id, header.nonce, tag,
                                     env.aad(name, header.identity))
        hasher = xxhash.xxh3_64() if checksum is not None else None
        try:
            decrypt_in_place(dec, view, hasher, tag)
            authentic = True
        except InvalidTag:
            authentic = False
        # A damaged payload fails both checks; it is reported as damage (as unencrypted ones are).
        # Authentic with a wrong checksum can only be a bad checksum field: refused all the same.
        if hasher is not None and hasher.intdigest() != checksum:
            raise env.EnvelopeError("checksum", f"{name}: the payload's checksum does not match")
        if not authentic:
            raise env.EnvelopeError("decrypt", f"{name}: decryption failed (wrong key or tampered)")

    def _conclude(self, names: list[str], out: Sequence[Buffer | None], sized: list[int],
                  final: list[ItemResult], bad: list[tuple[str, env.EnvelopeError]]) -> list[ItemResult]:
        """End of every verified load: classify size mismatches, refuse the bad, count the good."""
        if sized:
            self._classify_sizes(names, out, sized, final, bad)
        if bad:
            self._refuse(bad)
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

    def _refuse(self, bad: list[tuple[str, env.EnvelopeError]]) -> None:
        drop = []
        for name, e in bad:
            INTEGRITY_FAILURES.labels(self.tier, e.reason).inc()
            with self._logged_lock:
                first = name not in self._logged
                if first:
                    if len(self._logged) >= _LOGGED_MAX:
                        self._logged.clear()
                    self._logged.add(name)
            deleting = e.reason != "unsealed" or self.delete_unsealed
            if first:
                log.warning("integrity: %s refused on tier %s (%s, %s): %s; treated as a miss%s", name,
                            self.tier, self.url, e.reason, e, ", removed" if deleting else "")
            if deleting:
                drop.append(name)
        if drop:
            try:
                for r in self.inner.delete_many(drop):
                    if r.error is not None:
                        log.warning("integrity: could not remove refused %s from %s: %s", r.name, self.url,
                                    r.error)
            except StoreError as e:
                log.warning("integrity: could not remove %d refused objects from %s: %s", len(drop),
                            self.url, e)

    def refuse_names(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Count, log and remove objects found bad without a load (e.g. at an index rebuild)."""
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
        return [r if r.error is not None else ItemResult(r.name, size=self.payload_size(r.size))
                for r in self.inner.head_many(names)]

    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        return [r if r.error is not None else ItemResult(r.name, size=self.payload_size(r.size))
                for r in self.inner.delete_many(names)]

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        for info in self.inner.list(prefix, page_size=page_size):
            size = info.size - self.overhead if info.size >= self.overhead else info.size
            yield ObjectInfo(info.name, size, info.mtime)

    def check_headers(self, infos: Sequence[ObjectInfo]) -> list[str | None]:
        """For listed objects (payload sizes), the failure reason of each one's header, None if good.

        Reads only the 64-byte headers, and only when the inner store can read a prefix cheaply
        (a directory); elsewhere every answer is None (unknown until a load). Bad objects are
        counted and removed like a failed load.
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


def seal_store(
    store: ObjectStore,
    *,
    tier: str,
    identity: str | bytes | None = None,
    unsealed: str = "miss",
    encryption: Any = None,
    delete_unsealed: bool = False,
) -> SealedStore:
    """Wrap ``store`` in a :class:`SealedStore` unless it already is one (then it is returned as is).

    ``encryption`` is an ``encryption`` setting (None/False, True, a mapping with
    ``keyring_file``/``keyring_env``) or a :class:`Keyring`.
    """
    if isinstance(store, SealedStore):
        return store
    return SealedStore(store, tier=tier, identity=identity, unsealed=unsealed,
                       keyring=Keyring.from_setting(encryption), delete_unsealed=delete_unsealed)


def inspect_object(name: str, data: Buffer, keyring: Keyring | None = None,
                   tenant_of: Callable[[str], str] = tenant_of_name) -> tuple[str, str | None]:
    """Classify one stored object for ``kvbucket verify``: (good|corrupt|foreign|legacy, reason).

    Without a keyring, encrypted objects are checked up to their checksum (which covers the
    ciphertext), not authenticated.
    """
    view = memoryview(data)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    try:
        if view.nbytes < env.HEADER_SIZE:
            env.parse_header(view, name)
        header = env.parse_header(view[: env.HEADER_SIZE], name)
        payload = view[env.HEADER_SIZE :]
        env.check_payload(header, payload, name)
        if header.encrypted and keyring is not None:
            probe = SealedStore.__new__(SealedStore)
            probe.keyring, probe.tenant_of = keyring, tenant_of
            if not keyring.has_key(tenant_of(name), header.key_id):
                raise env.EnvelopeError("key", f"{name}: key id {header.key_id} is not in the keyring")
            plain = bytearray(payload[: -env.TAG_SIZE])
            SealedStore._decrypt(probe, name, header, memoryview(plain), bytes(payload[-env.TAG_SIZE :]))
    except env.EnvelopeError as e:
        if e.reason == "unsealed":
            return "legacy", e.reason
        if e.reason in ("name", "identity", "key", "decrypt"):
            return "foreign", e.reason
        return "corrupt", e.reason
    return "good", None


__all__ = ["UNSEALED_POLICIES", "SealedStore", "inspect_object", "seal_store", "tenant_of_name"]
