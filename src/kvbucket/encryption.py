"""Encryption at rest, opt-in: AES-256-GCM per tenant (``cache_salt``), keys from a keyring.

A keyring maps a tenant to its keys by id. New writes use the tenant's highest key id; reads
find the key by the id in the envelope, so chunks sealed under an older key stay readable while
that key is in the ring (rotation = add a key with a higher id; retire = remove the old one).
The tenant ``*`` is the fallback for tenants without keys of their own.

Keyring sources, in the ``encryption`` setting (engine config, L2 adapter JSON, transformers):

- ``{"keyring_file": "/path/keys.json"}``: a JSON file ``{"tenants": {"team-a": {"1": "<base64
  of 32 bytes>", "2": "..."}, "*": {"1": "..."}}}``;
- ``{"keyring_env": "KVBUCKET_KEYRING"}`` (the default source): the same JSON in an
  environment variable;
- ``KVBUCKET_ENCRYPTION_KEY`` (base64 of 32 bytes): shorthand for tenant ``*``, key id 1.

Key material never appears in reprs, logs, errors or metrics: only tenants and key ids do.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvbucket.errors import ConfigError
from kvbucket.secrets import remember

KEY_BYTES = 32
NONCE_BYTES = 12
DEFAULT_TENANT = "*"
DEFAULT_KEYRING_ENV = "KVBUCKET_KEYRING"
SINGLE_KEY_ENV = "KVBUCKET_ENCRYPTION_KEY"
# Bytes per block when sealing and opening: each block is copied or en/decrypted and hashed
# while it is in a core's L2 cache (decrypting in place, its plaintext goes through a scratch
# buffer of this size). Measured on 2 MiB chunks: 256 KiB blocks beat 1 MiB ones by ~15%.
BLOCK = 256 << 10
SCRATCH_KEEP = 64 << 20  # largest scratch a thread keeps between loads (bigger ones are freed)
# Objects at least this large are decrypted on a helper thread while the next one is read
# (measured on 2 cores: 2 MiB 1.56-1.68x quiet, 0.98-0.99 with one core busy; 1 MiB 1.23x but
# 0.94 busy; 256 KiB 0.57: the handoff costs more than it overlaps).
HANDOFF_MIN = 2 << 20
_scratch = threading.local()
_pool: Any = None
_pool_lock = threading.Lock()
_IDLE_WINDOW_SECS = 0.5
_SPARE_MIN = 0.75  # of a core, idle or this process's, beyond the caller's own
_idle_sample: tuple[float, float, float] | None = None
_spare = False


class EncryptionConfig(BaseModel):
    """The ``encryption`` setting: ``{"keyring_file": "..."}`` or ``{"keyring_env": "VAR"}``.

    Both unset means ``$KVBUCKET_KEYRING`` (or ``$KVBUCKET_ENCRYPTION_KEY``). Holds no key
    material itself, only where to find it.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    enabled: bool = True
    keyring_file: str | None = None
    keyring_env: str | None = None


def _decode_key(tenant: str, key_id: str, value: Any) -> bytes:
    remember(str(value))  # a keyring entry: masked in every output from now on (kvbucket.secrets)
    try:
        raw = base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"key {key_id} of tenant {tenant!r} is not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise ConfigError(
            f"key {key_id} of tenant {tenant!r} is {len(raw)} bytes; AES-256 keys are {KEY_BYTES} bytes "
            "(generate one with: python -c "
            "\"import os,base64; print(base64.b64encode(os.urandom(32)).decode())\")"
        )
    return raw


class Keyring:
    """Tenant -> {key id -> AES-256 key}. Holds secrets: its repr shows only tenants and ids."""

    def __init__(self, tenants: Mapping[str, Mapping[int, bytes]]) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401 - fail early

        self._keys: dict[str, dict[int, bytes]] = {}
        for tenant, keys in tenants.items():
            ring = {}
            for kid, key in keys.items():
                if not isinstance(kid, int) or not 0 < kid < 2**32:
                    raise ConfigError(f"key ids are integers 1..4294967295; tenant {tenant!r} has {kid!r}")
                if len(key) != KEY_BYTES:
                    raise ConfigError(f"key {kid} of tenant {tenant!r} is not {KEY_BYTES} bytes")
                ring[kid] = bytes(key)
            if ring:
                self._keys[str(tenant)] = ring
        if not self._keys:
            raise ConfigError("the encryption keyring holds no keys")
        self._aeads: dict[tuple[str, int], Any] = {}

    # ---- sources ------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str, where: str) -> Keyring:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the keyring in {where} is not valid JSON (line {e.lineno})") from None
        tenants = doc.get("tenants") if isinstance(doc, dict) else None
        if not isinstance(tenants, dict):
            raise ConfigError(
                f'the keyring in {where} needs a "tenants" object: tenant -> key id -> base64 key'
            )
        parsed: dict[str, dict[int, bytes]] = {}
        for tenant, keys in tenants.items():
            if not isinstance(keys, dict):
                raise ConfigError(f"tenant {tenant!r} in {where} must map key ids to base64 keys")
            ring = {}
            for kid, value in keys.items():
                try:
                    ring[int(kid)] = _decode_key(tenant, str(kid), value)
                except ValueError as e:
                    if isinstance(e, ConfigError):
                        raise
                    raise ConfigError(
                        f"key id {kid!r} of tenant {tenant!r} in {where} is not an integer"
                    ) from None
            parsed[tenant] = ring
        return cls(parsed)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keyring:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read the keyring file {os.fspath(path)!r}: {e.strerror}") from None
        return cls.from_json(text, f"file {os.fspath(path)!r}")

    @classmethod
    def from_env(cls, var: str = DEFAULT_KEYRING_ENV) -> Keyring:
        text = os.environ.get(var)
        if text:
            return cls.from_json(text, f"${var}")
        single = os.environ.get(SINGLE_KEY_ENV)
        if single:
            return cls({DEFAULT_TENANT: {1: _decode_key(DEFAULT_TENANT, "1", single.strip())}})
        raise ConfigError(
            f"encryption is on but no keyring was found: set ${var} (JSON keyring), ${SINGLE_KEY_ENV} "
            "(base64 of 32 bytes), or keyring_file in the encryption setting"
        )

    @classmethod
    def from_setting(cls, setting: Any) -> Keyring | None:
        """The keyring an ``encryption`` setting names (None/False: encryption off)."""
        if setting is None or setting is False:
            return None
        if isinstance(setting, Keyring):
            return setting
        if setting is True:
            return cls.from_env()
        if hasattr(setting, "model_dump"):
            setting = setting.model_dump()
        if not isinstance(setting, Mapping):
            raise ConfigError("encryption must be true, false, or {keyring_file: ..., keyring_env: ...}")
        if not setting.get("enabled", True):
            return None
        if setting.get("keyring_file"):
            return cls.from_file(setting["keyring_file"])
        return cls.from_env(setting.get("keyring_env") or DEFAULT_KEYRING_ENV)

    # ---- use ----------------------------------------------------------------------------
    def _ring(self, tenant: str) -> dict[int, bytes] | None:
        return self._keys.get(tenant) or self._keys.get(DEFAULT_TENANT)

    def write_key_id(self, tenant: str) -> int | None:
        ring = self._ring(tenant)
        return max(ring) if ring else None

    def has_key(self, tenant: str, key_id: int) -> bool:
        ring = self._ring(tenant)
        return ring is not None and key_id in ring

    def aead(self, tenant: str, key_id: int) -> Any:
        """The one-shot AES-256-GCM cipher of a key (cached): ``decrypt_into`` releases the GIL
        and runs ~1.4x faster here than the streaming decryptor (docs/integrity.md, "Cost")."""
        cached = self._aeads.get((tenant, key_id))
        if cached is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            ring = self._ring(tenant)
            assert ring is not None
            cached = self._aeads[(tenant, key_id)] = AESGCM(ring[key_id])
        return cached

    def encryptor(self, tenant: str, key_id: int, nonce: bytes, aad: bytes) -> Any:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        ring = self._ring(tenant)
        assert ring is not None
        enc = Cipher(algorithms.AES(ring[key_id]), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        return enc

    def decryptor(self, tenant: str, key_id: int, nonce: bytes, tag: bytes, aad: bytes) -> Any:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        ring = self._ring(tenant)
        assert ring is not None
        dec = Cipher(algorithms.AES(ring[key_id]), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        return dec

    def __repr__(self) -> str:
        ids = {t: sorted(r) for t, r in self._keys.items()}
        return f"Keyring(key ids per tenant: {ids})"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickled into a child's argv or a log by accident
        raise TypeError("a Keyring cannot be pickled; build it from its source in each process")


def scratch(nbytes: int, slot: int = 0) -> memoryview:
    """A writable buffer of ``nbytes`` reused by this thread (two slots, each kept while at most
    :data:`SCRATCH_KEEP`): local encrypted loads read each object into one (warm in cache, no
    page faults) and decrypt it from there into the caller's buffer."""
    bufs = getattr(_scratch, "whole", None)
    if bufs is None:
        bufs = _scratch.whole = [bytearray(0), bytearray(0)]
    buf = bufs[slot]
    if len(buf) < nbytes:
        buf = bytearray(nbytes)
        if nbytes <= SCRATCH_KEEP:
            bufs[slot] = buf
    return memoryview(buf)[:nbytes]


class Handoff:
    """A call that a helper thread runs, unless the caller takes it back first (:meth:`finish`).

    Local encrypted loads of large objects decrypt object ``i`` this way while the next one is
    read: ``decrypt_into`` releases the GIL, so on a machine with an idle core the two overlap.
    On a busy one the helper may not run in time; then the caller runs the call itself rather
    than wait (and the load stops handing off, see ``SealedStore``).
    """

    __slots__ = ("_claimed", "_fn", "_future", "_lock")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._claimed = False
        self._future = _helpers().submit(self._run)

    def _run(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
        self._fn()
        return True

    def finish(self) -> bool:
        """Complete the call: here if the helper has not started it (returns True), else wait
        for the helper (returns False). Raises what the call raised."""
        if self._run():
            return True
        self._future.result()
        return False


def _helpers() -> Any:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                from kvbucket.threads import DaemonThreadPool

                _pool = DaemonThreadPool(max(1, min(4, (os.cpu_count() or 1) - 1)), "kvbucket-decrypt")
    return _pool


def spare_cores() -> bool:
    """Whether a core beyond the caller's was idle lately (so handing work off can pay).

    Measured, not assumed: from ``/proc/stat`` over the last :data:`_IDLE_WINDOW_SECS` or
    more, the machine's idle cores plus this process's own CPU use (its helper threads' share
    is available to it) minus the caller's core. False where that cannot be read, and until a
    first window has passed. On a machine whose cores are all busy a helper thread would only
    take turns with the caller: measured slower (2 MiB AES loads 0.66 vs 0.73 of verified).
    """
    global _idle_sample, _spare
    now = time.monotonic()
    last = _idle_sample
    if last is not None and now - last[0] < _IDLE_WINDOW_SECS:
        return _spare
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return False
    idle = (ticks[3] + ticks[4]) / hz  # idle + iowait seconds, summed over cores
    t = os.times()
    own = t.user + t.system
    _idle_sample = (now, idle, own)
    if last is not None:
        window = now - last[0]
        _spare = ((idle - last[1]) + (own - last[2])) / window - 1.0 >= _SPARE_MIN
    return _spare


def encrypt_into(enc: Any, src: memoryview, dst: memoryview, hasher: Any = None) -> bytes:
    """Encrypt ``src`` into ``dst`` (``len(src) + 16`` bytes: ciphertext then tag); returns the tag.

    With ``hasher``, each ciphertext block is hashed right after it is written (in cache), then
    the tag: the envelope's checksum without a second pass over the payload.
    """
    n = src.nbytes
    pos = 0
    for off in range(0, n, BLOCK):
        # update_into needs len(data) + 15 bytes of room: dst always has the 16-byte tag after.
        k = enc.update_into(src[off : off + BLOCK], dst[pos:])
        if hasher is not None:
            hasher.update(dst[pos : pos + k])
        pos += k
    tail = enc.finalize()
    if tail:  # GCM is a stream mode: nothing is held back, but a tail would be placed right
        dst[pos : pos + len(tail)] = tail
        if hasher is not None:
            hasher.update(tail)
        pos += len(tail)
    tag = enc.tag
    dst[pos : pos + len(tag)] = tag
    if hasher is not None:
        hasher.update(tag)
    return bytes(tag)


def decrypt_in_place(dec: Any, view: memoryview, hasher: Any = None, tag: bytes = b"") -> None:
    """Decrypt ``view`` in place through a small scratch buffer; raises InvalidTag on failure.

    Block by block (:data:`BLOCK`, cache-sized): each ciphertext block is fed to ``hasher``
    (then ``tag``), decrypted into the scratch buffer and copied back while all three are in
    cache, so checksum, decryption and copy cost one pass over memory, not three.
    """
    scratch = getattr(_scratch, "buf", None)
    if scratch is None:
        scratch = _scratch.buf = bytearray(BLOCK + 32)
    sv = memoryview(scratch)
    n = view.nbytes
    wpos = 0
    for off in range(0, n, BLOCK):
        block = view[off : off + BLOCK]
        if hasher is not None:
            hasher.update(block)
        k = dec.update_into(block, sv)
        view[wpos : wpos + k] = sv[:k]
        wpos += k
    if hasher is not None:
        hasher.update(tag)
    tail = dec.finalize()
    view[wpos : wpos + len(tail)] = tail


__all__ = [
    "BLOCK", "DEFAULT_TENANT", "HANDOFF_MIN", "KEY_BYTES", "SCRATCH_KEEP", "EncryptionConfig", "Handoff",
    "Keyring", "decrypt_in_place", "encrypt_into", "scratch", "spare_cores",
]
