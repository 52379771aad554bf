"""The object-store protocol: a flat namespace of immutable blobs, batch-first.

Every persistent tier of kvbucket (chunk backends, L2 adapters, the compile cache, the CLI) is
written once against :class:`ObjectStore`. A store holds objects under *names*: relative,
``/``-separated paths that can never climb out of the store's prefix (see :func:`check_name`).

All verbs take batches and answer with one :class:`ItemResult` per input, in input order,
because remote batches can partly fail and callers must count exactly what landed. A verb
raises only when the whole call is unusable (bad arguments, closed store); per-object
failures are reported in the results.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvbucket.errors import InvalidKeyError, StoreError
from kvbucket.stores.buffers import Buffer, Gather, Scatter, check_buffer_size

MAX_NAME_BYTES = 1024


@dataclass(frozen=True, slots=True)
class ItemResult:
    """The outcome of one object in a batch.

    ``size`` is the object's size when it exists (stored, found, or removed), ``None`` when it is
    missing. ``data`` is set by ``get_many``: the caller's buffer when one was given, else a
    bytes-like object. ``error`` is set when this item failed; ``size``/``data`` are then ``None``.
    ``version`` names the version of the object read or written, where the store knows it cheaply
    (always for :meth:`ObjectStore.get_versions`): what :meth:`ObjectStore.delete_versions` takes.
    """

    name: str
    size: int | None = None
    data: Buffer | None = None
    error: StoreError | None = None
    version: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def found(self) -> bool:
        return self.error is None and self.size is not None


@dataclass(frozen=True, slots=True)
class Revision:
    """What :meth:`ObjectStore.get_if_changed` found: ``tag`` names the object's current version
    (None: missing); ``data`` is its content, None when it is missing or still at the tag asked."""

    tag: str | None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One entry of a listing. ``mtime`` is seconds since the epoch when the store knows it;
    ``version`` names the listed version (what :meth:`ObjectStore.delete_versions` takes)."""

    name: str
    size: int
    mtime: float | None = None
    version: str | None = None


@dataclass(frozen=True, slots=True)
class VersionedDelete:
    """The outcome of one item of :meth:`ObjectStore.delete_versions`.

    ``removed``: the version named was removed. ``changed``: the name holds another version now
    (someone wrote it since the judgement): kept, and not an error. Neither: it was already gone.
    """

    name: str
    removed: bool = False
    changed: bool = False
    error: StoreError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def check_name(name: str) -> str:
    """Validate an object name and return it, or raise :class:`InvalidKeyError`.

    A name is a relative path of non-empty segments joined by ``/``; it has no ``.``/``..``
    segment, no backslash, no NUL or other control character, is valid Unicode (no lone
    surrogate, which no store can encode: refusing it here, before any item of a batch is
    written, keeps a batch from failing half-way) and has at most 1,024 UTF-8 bytes. These
    rules make it impossible for a name to escape the store's prefix on any backend (a
    directory, S3, a bucket).
    """
    if not isinstance(name, str):
        raise InvalidKeyError(f"object name must be a str, got {type(name).__name__}")
    return _check_name_cached(name)


_CONTROL_RE = re.compile("[\x00-\x1f\x7f]")


@functools.lru_cache(maxsize=65536)
def _check_name_cached(name: str) -> str:
    # Cached: lookups of 1,000 keys validate the same names again and again; only valid
    # names are cached (a raise is not).
    if not name:
        raise InvalidKeyError("object name is empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(
            f"object name {name!r} is not valid UTF-8 (it holds a lone surrogate, e.g. a file name "
            "decoded with surrogateescape); pass names as proper text"
        ) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidKeyError(f"object name is longer than {MAX_NAME_BYTES} bytes: {name[:60]!r}...")
    if _CONTROL_RE.search(name):
        raise InvalidKeyError(f"object name contains a control character: {name!r}")
    if "\\" in name:
        raise InvalidKeyError(f"object name contains a backslash: {name!r}")
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidKeyError(
                f"object name {name!r} has an empty, '.' or '..' segment; names are relative "
                "paths that cannot leave the store's prefix"
            )
    return name


def check_prefix(prefix: str) -> str:
    """Normalise a store prefix (``""`` or a valid name without a trailing slash)."""
    prefix = prefix.strip("/")
    return check_name(prefix) if prefix else ""


class ObjectStore(abc.ABC):
    """A flat namespace of immutable blobs. Implementations are thread-safe.

    Subclasses implement the five batch verbs. Names passed in are validated with
    :func:`check_name` by the subclass (through :meth:`_names`); listing yields names relative
    to the store's prefix, so ``list()`` output can be fed back to ``get_many``.
    """

    #: A URL naming this store, safe to print (never holds credentials).
    url: str = ""

    # ---- the protocol -------------------------------------------------------------------
    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[ItemResult]:
        """Store each (name, bytes-like). Overwrites. ``size`` of a result is the bytes stored."""

    @abc.abstractmethod
    def get_many(self, names: Sequence[str], out: Sequence[Buffer | None] | None = None) -> list[ItemResult]:
        """Read objects. A missing object is a result with ``size=None`` and no error.

        With ``out``, ``out[i]`` (when not None) is a writable buffer that receives object i;
        its length must equal the object's size, otherwise that item fails with
        :class:`SizeMismatchError` and the buffer is not written.
        """

    @abc.abstractmethod
    def head_many(self, names: Sequence[str]) -> list[ItemResult]:
        """Sizes of objects (``size=None`` when missing)."""

    @abc.abstractmethod
    def delete_many(self, names: Sequence[str]) -> list[ItemResult]:
        """Remove objects. Removing a missing object succeeds with ``size=None``.

        ``size`` is the removed object's size when the store knows it cheaply, else ``None``.
        """

    @abc.abstractmethod
    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        """Lazily list objects whose name starts with ``prefix`` (a plain string prefix)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads. Idempotent."""

    # ---- versions: every delete kvbucket makes on its own initiative (docs/integrity.md) -----
    def get_versions(self, names: Sequence[str]) -> list[ItemResult]:
        """Read each object whole and afresh (no cache; a remote store uses a new connection and,
        for a bucket, a new reconstruction), each result's ``version`` naming the bytes read.

        What a reader judges before it removes an object: the judgement then names its version.
        A wrapper (``self.inner``: sealing, metrics, read-ahead) passes it on: versions and bytes
        are the stored ones (a sealed store's: envelope included). Other stores without an
        implementation name no version: every item fails, and nothing is removed by it.
        """
        inner = getattr(self, "inner", None)
        if isinstance(inner, ObjectStore):
            return inner.get_versions(names)
        err = StoreError(f"{type(self).__name__} cannot name object versions; nothing is removed by version")
        return [ItemResult(n, error=err) for n in self._names(names)]

    def delete_versions(self, items: Sequence[tuple[str, str]]) -> list[VersionedDelete]:
        """Remove each ``(name, version)`` only while the name still holds that version; an object
        written since (another version) is kept and reported ``changed``, not as an error.

        A wrapper (``self.inner``) passes it on; a store without an implementation cannot compare
        versions: every item fails and is kept.
        """
        inner = getattr(self, "inner", None)
        if isinstance(inner, ObjectStore):
            return inner.delete_versions(items)
        err = StoreError(f"{type(self).__name__} cannot delete by version; nothing was removed")
        return [VersionedDelete(n, error=err) for n, _ in items]

    # ---- conveniences built on the protocol --------------------------------------------
    def put(self, name: str, data: Buffer) -> int:
        (r,) = self.put_many([(name, data)])
        if r.error is not None:
            raise r.error
        return int(r.size or 0)

    def get(self, name: str) -> bytes | None:
        (r,) = self.get_many([name])
        if r.error is not None:
            raise r.error
        return None if r.data is None else bytes(r.data)

    def get_if_changed(self, name: str, tag: str | None) -> Revision:
        """Read ``name`` unless it is still at version ``tag`` (a conditional GET).

        Stores that can ask the server (S3's ``If-None-Match`` on the ETag, a bucket's file hash)
        override this so an unchanged object costs one small request and no body; this default
        reads the object and compares a hash of its bytes.
        """
        data = self.get(name)
        if data is None:
            return Revision(None)
        now = hashlib.blake2b(data, digest_size=16).hexdigest()
        return Revision(now, None if now == tag else data)

    def get_into(self, name: str, buffer: Buffer) -> bool:
        """Read ``name`` into ``buffer``; False when missing, raises on a size mismatch."""
        (r,) = self.get_many([name], [buffer])
        if r.error is not None:
            raise r.error
        return r.size is not None

    def head(self, name: str) -> int | None:
        (r,) = self.head_many([name])
        if r.error is not None:
            raise r.error
        return r.size

    def exists(self, name: str) -> bool:
        return self.head(name) is not None

    def delete(self, name: str) -> None:
        (r,) = self.delete_many([name])
        if r.error is not None:
            raise r.error

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ---- helpers for implementations ----------------------------------------------------
    @staticmethod
    def _names(names: Sequence[str]) -> list[str]:
        return [check_name(n) for n in names]


def closed_during(url: str) -> StoreError:
    """The error of an item a store's close() ended while its call was in flight (every family
    says it in the same words: nothing of the item was read or counted)."""
    return StoreError(f"{url} was closed during this call")


def raise_first_error(results: Sequence[ItemResult]) -> None:
    """Raise the first per-item error of a batch (for callers that want all-or-nothing)."""
    for r in results:
        if r.error is not None:
            raise r.error


__all__ = [
    "Buffer",
    "Gather",
    "ItemResult",
    "ObjectInfo",
    "ObjectStore",
    "Revision",
    "Scatter",
    "StoreError",
    "VersionedDelete",
    "check_buffer_size",
    "check_name",
    "check_prefix",
    "closed_during",
    "raise_first_error",
]
