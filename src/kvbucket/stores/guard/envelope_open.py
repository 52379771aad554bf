"""Opening envelopes: the checks and decryption every verified load runs, and ``verify``'s classifier.

:class:`EnvelopeOpener` holds what a reader knows (its KV layout identity, its keyring, how a
name maps to a tenant) and opens one object read whole, or read into a caller's buffer through
a :class:`Scatter`, raising :class:`~kvbucket.envelope.EnvelopeError` with the reason.
:class:`~kvbucket.stores.guard.sealed.SealedStore` is one; :func:`inspect_object` (``kvbucket verify``)
uses one too. What happens to a refused object is :mod:`kvbucket.stores.guard.refusals`' decision.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from kvbucket import envelope as env
from kvbucket.encryption import Keyring, decrypt_in_place
from kvbucket.errors import StoreError
from kvbucket.keys import decode_key
from kvbucket.stores.base import Buffer, ItemResult, Scatter
from kvbucket.stores.guard.refusals import DAMAGE


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


class EnvelopeOpener:
    """Header checks, payload checks and decryption for one reader (see the module docstring)."""

    identity: bytes
    keyring: Keyring | None
    tenant_of: Callable[[str], str]

    def __init__(self, identity: bytes = env.NO_IDENTITY, keyring: Keyring | None = None,
                 tenant_of: Callable[[str], str] | None = None) -> None:
        self.identity = identity
        self.keyring = keyring
        self.tenant_of = tenant_of if tenant_of is not None else tenant_of_name

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
                dst = Scatter(bytearray(env.HEADER_SIZE), *parts, hasher=xxhash.xxh3_64(),
                              hash_from=env.HEADER_SIZE)
            else:
                dst = Scatter(bytearray(env.HEADER_SIZE), parts[0], bytearray(env.TAG_SIZE))
        except (ValueError, TypeError) as e:
            raise StoreError(f"the buffer given for {name!r} cannot be read into: {e}") from None
        if isinstance(buf, Scatter) and buf.on_wrap is not None:
            buf.on_wrap(dst)  # the caller's regions are written through dst (a read-ahead redirects it)
        return dst

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
            if header.encrypted:
                raise env.EnvelopeError("no_keyring", f"{name}: the object is encrypted but no keyring "
                                                      "is configured")
            raise env.EnvelopeError("plaintext", f"{name}: the object is not encrypted but encryption is on")
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


def written_under(name: str, data: Buffer) -> str | None:
    """The trailing part of ``name`` (whole ``/`` components dropped from its front) whose digest
    the envelope in ``data`` holds: the name it was written under, relative to a root below the
    one it was listed from. None when no such part (or no intact envelope) is found."""
    digest = env.written_digest(memoryview(data)[: env.HEADER_SIZE])
    if digest is None:
        return None
    parts = name.split("/")
    for i in range(1, len(parts)):
        below = "/".join(parts[i:])
        if env.name_digest(below) == digest:
            return below
    return None


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
            probe = EnvelopeOpener(keyring=keyring, tenant_of=tenant_of)
            if not keyring.has_key(tenant_of(name), header.key_id):
                raise env.EnvelopeError("key", f"{name}: key id {header.key_id} is not in the keyring")
            plain = bytearray(payload[: -env.TAG_SIZE])
            probe._decrypt(name, header, memoryview(plain), bytes(payload[-env.TAG_SIZE :]))
    except env.EnvelopeError as e:
        if e.reason == "unsealed":
            return "legacy", e.reason
        if e.reason in DAMAGE:
            return "corrupt", e.reason
        return "foreign", e.reason  # another name, layout, key or format: maybe good for its writer
    return "good", None


__all__ = ["EnvelopeOpener", "inspect_object", "tenant_of_name", "written_under"]
